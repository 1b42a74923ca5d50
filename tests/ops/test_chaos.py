"""Recovery, as numbers: exactly-once training bit for bit, the report of a run that died, the loss
counters of `gyre chaos`, and a real job whose killed service is restarted and which completes.

Real processes throughout: the exactly-once probe SIGKILLs a real trainer process; the job test runs
`gyre chaos` (every service its own supervised process, embedded NATS and Postgres).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from app.chaos import count_double_leases, execution_fates, plan_faults
from app.chaos_counts import lost_execution_fates
from app.job.report import OUTCOME_NAME, build_report, headline, incomplete_reason
from tests.job.conftest import write_synthetic_run

ROOT = Path(__file__).resolve().parents[2]


def run_chaos(args: list[str], tmp_path: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`python -m app.chaos ARGS` with stderr kept in a file, so that a run that overstays its budget
    fails with the tail of what it printed instead of a bare timeout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    err_path = tmp_path / "chaos.stderr"
    with err_path.open("w") as err:
        try:
            out = subprocess.run(
                [sys.executable, "-m", "app.chaos", *args],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout_s,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"gyre chaos ran past {timeout_s} s; its stderr ends:\n{err_path.read_text()[-4000:]}"
            )
    return subprocess.CompletedProcess(out.args, out.returncode, out.stdout, err_path.read_text())


def _lease(kind: str, device: str, holder: str, epoch: int) -> dict:
    return {"kind": kind, "lease": {"device_id": device, "holder": holder, "epoch": str(epoch)}}


def test_a_handoff_through_release_is_not_a_double_lease_but_an_overlapping_acquire_is() -> None:
    handoff = [
        _lease("KIND_REGISTERED", "d0", "rollout-0", 1),
        _lease("KIND_RELEASED", "d0", "", 2),
        _lease("KIND_ACQUIRED", "d0", "trainer-0", 3),
    ]
    overlap = [
        _lease("KIND_REGISTERED", "d0", "rollout-0", 1),
        _lease("KIND_ACQUIRED", "d0", "trainer-0", 2),  # rollout-0 never released it
    ]
    stale = [*handoff, _lease("KIND_RELEASED", "d0", "", 4), _lease("KIND_ACQUIRED", "d0", "rollout-0", 3)]
    assert count_double_leases(handoff) == 0
    assert count_double_leases(overlap) == 1
    assert count_double_leases(stale) == 1  # an epoch that does not grow is a fencing failure


def _ex(eid: str, kind: str, at: float) -> dict:
    return {"execution_id": eid, "kind": kind, "created_unix_s": at}


def test_executions_live_at_a_rollout_kill_are_counted_resumed_restarted_or_unended() -> None:
    kill = 10.0
    events = [
        _ex("done-before", "KIND_STARTED", 1), _ex("done-before", "KIND_FINISHED", 5),
        _ex("resumed", "KIND_STARTED", 2), _ex("resumed", "KIND_RESUMED", 12), _ex("resumed", "KIND_TRUNCATED", 20),
        _ex("ended", "KIND_STARTED", 3), _ex("ended", "KIND_FAILED", 12),  # ended by the successor
        _ex("resumed-failed", "KIND_STARTED", 3), _ex("resumed-failed", "KIND_RESUMED", 12),
        _ex("resumed-failed", "KIND_FAILED", 13),  # "could not resume": not saved
        _ex("stuck", "KIND_STARTED", 4),
        _ex("resumed-running", "KIND_STARTED", 4), _ex("resumed-running", "KIND_RESUMED", 12),
        _ex("after", "KIND_STARTED", 11), _ex("after", "KIND_FINISHED", 15),
    ]  # fmt: skip
    fates = execution_fates(events, [kill])
    assert fates == {
        "resumed": "resumed",
        "ended": "restarted",
        "resumed-failed": "restarted",
        "stuck": "unended",
        "resumed-running": "resumed_unended",  # the job stopped while it ran
    }
    # resumed at an earlier kill, then killed again and not resumed after the second one
    twice = execution_fates([*events, _ex("x", "KIND_STARTED", 1), _ex("x", "KIND_RESUMED", 11),
                             _ex("x", "KIND_FAILED", 31)], [kill, 30.0])  # fmt: skip
    assert twice["x"] == "restarted" and twice["resumed"] == "resumed"


def test_an_execution_resumed_and_running_at_the_jobs_stop_is_not_lost_but_an_unresumed_one_is() -> None:
    fates = {
        "r": "resumed_unended",
        "done": "resumed",
        "gone": "unended",
        "failed": "restarted",
        "kept": "unended",
    }
    started = {eid: {"group_id": f"g-{eid}"} for eid in fates}
    lost = lost_execution_fates(fates, started, scored_groups={"g-kept"})
    assert lost == {"gone": "unended", "failed": "restarted"}


def test_faults_are_spread_over_the_run_in_order_and_before_its_last_two_steps() -> None:
    faults = plan_faults(
        ["scheduler", "rollout", "trajectory", "trainer", "nats", "postgres"], 20, random.Random(0)
    )
    steps = [f.at_step for f in faults]
    assert [f.target for f in faults][0] == "scheduler" and steps == sorted(steps)
    assert steps[0] >= 1 and steps[-1] <= 20 - 2
    assert all(0.0 <= f.delay_s <= 3.0 for f in faults)


@pytest.mark.slow
def test_a_report_of_a_run_that_did_not_complete_says_so_and_never_that_it_learned(tmp_path: Path) -> None:
    write_synthetic_run(tmp_path, num_steps=10, reward_slope=0.06)  # rising reward: would be "learned"
    (tmp_path / OUTCOME_NAME).write_text(json.dumps({"completed": False, "reason": "service down for good"}))
    report = build_report(tmp_path)
    text = report.report_path.read_text()
    summary = json.loads(report.summary_path.read_text())
    lines = headline(report.analysis, incomplete_reason(tmp_path))
    assert "This run did not complete" in text and "service down for good" in text
    assert "learned: yes" not in text
    assert summary["completed"] is False and summary["learned"] is False
    assert summary["learned_over_steps_run"] is True  # what the steps that ran showed, kept apart
    assert lines[0].startswith("run did NOT complete") and not any("learned: yes" in x for x in lines)


def test_the_same_run_completed_is_judged_learned(tmp_path: Path) -> None:
    write_synthetic_run(tmp_path, num_steps=10, reward_slope=0.06)
    report = build_report(tmp_path, extra={"job_completed": True, "job_end_reason": "done"})
    assert report.summary["completed"] is True and report.summary["learned"] is True


@pytest.mark.slow
@pytest.mark.integration
def test_a_trainer_killed_and_restarted_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path: Path) -> None:
    from app.exactly_once import run_probe

    result = run_probe(tmp_path / "probe", ROOT / "examples" / "quickstart.yaml", steps=6, seed=1)
    assert result["trainer_killed_exit"] == -9  # it really was SIGKILLed mid-run
    assert 1 <= result["trainer_killed_after_step"] < 6
    assert result["trainer_bitwise_equal"] is True


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_a_job_whose_rollout_is_killed_restarts_it_and_completes_losing_nothing(tmp_path: Path) -> None:
    proc = run_chaos(
        ["examples/quickstart.yaml", "--json", "--steps", "5"]
        + ["--targets", "rollout", "--run-dir", str(tmp_path / "run")],
        tmp_path,
        timeout_s=1500,
    )
    assert proc.stdout.strip(), proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    (fault,) = result["faults"]
    assert fault["target"] == "rollout" and fault["recovered"], fault
    assert result["restarts"].get("rollout", 0) >= 1
    assert result["completed"] is True
    for counter in ("steps_lost", "paths_trained_twice", "batches_lost", "double_leases", "executions_lost"):
        assert result[counter] == 0, (counter, result.get("executions_lost_fates"), result)
    assert result["steps_stored"] >= result["steps_emitted"] > 0
    live = result["executions_live_at_kill"]
    assert live > 0, result  # the kill waits for live executions (app/chaos.py)
    assert result["executions_resumed"] + result["executions_restarted"] <= live
    assert result["executions_resumed"] >= 0.95 * live, result  # resumed under their own ids
    stats = json.loads((tmp_path / "run" / "final_stats.json").read_text())
    assert "executions_started" in stats["rollout"]  # the rollout's counters, read before it stopped
    report = (tmp_path / "run" / "report.md").read_text()
    assert re.search(r"Services restarted by the supervisor: .*rollout [1-9]\d*x", report), report[-2000:]


def test_executions_live_at_an_engine_kill_must_finish_and_one_that_fails_or_never_ends_is_lost() -> None:
    from app.chaos import engine_kill_fates

    kill = 10.0
    events = [
        _ex("before", "KIND_STARTED", 1), _ex("before", "KIND_FINISHED", 5),
        _ex("lived", "KIND_STARTED", 2), _ex("lived", "KIND_TRUNCATED", 20),
        _ex("failed", "KIND_STARTED", 3), _ex("failed", "KIND_FAILED", 12),
        _ex("stuck", "KIND_STARTED", 4),
        _ex("after", "KIND_STARTED", 11), _ex("after", "KIND_FAILED", 15),
    ]  # fmt: skip
    assert engine_kill_fates(events, [kill]) == {"lived": "finished", "failed": "failed", "stuck": "unended"}
    assert engine_kill_fates(events, []) == {}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_a_job_on_a_nats_cluster_survives_an_engine_kill_and_the_loss_of_the_steps_stream_leader(
    tmp_path: Path,
) -> None:
    proc = run_chaos(
        ["examples/quickstart.yaml", "--json", "--steps", "6"]
        + ["--targets", "engine,nats-node", "--run-dir", str(tmp_path / "run")],
        tmp_path,
        timeout_s=1500,
    )
    assert proc.stdout.strip(), proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    engine, node = result["faults"]
    assert engine["target"] == "engine" and engine["recovered"], engine
    assert engine["detail"]["rollout_died"] is False and engine["detail"]["engine_restarts"] == 1
    assert engine["detail"]["engine_killed"] not in engine["detail"]["engines_after"]  # a fresh one serves
    assert engine["restarts"] == []  # no process was restarted: the rollout lived
    assert result["engine_kill_executions_live"] > 0, result  # the kill waited for a busy engine
    assert result["engine_kill_executions_lost"] == 0
    assert result["engine_kill_executions_finished"] == result["engine_kill_executions_live"]
    assert node["target"] == "nats-node" and node["recovered"], node
    assert node["detail"]["node"] == f"nats-{node['detail']['steps_stream_leader']}"  # the leader died
    # The node first; a service whose publish waited out a leader election (> 10 s when the killed
    # node also led the JetStream meta group) exits and is restarted too, which the counters cover.
    assert node["restarts"][0] == node["detail"]["node"]
    assert set(node["restarts"][1:]) <= {"scheduler", "trajectory", "trainer", "rollout"}
    assert result["nats_cluster_size"] == 3
    assert result["nats_replicas_agree"] is True  # every node holds every step, the killed one too
    assert result["nats_steps_stored_per_node"][0] >= result["steps_emitted"] > 0
    assert result["completed"] is True
    for counter in ("steps_lost", "paths_trained_twice", "batches_lost", "double_leases", "executions_lost"):
        assert result[counter] == 0, (counter, result.get("executions_lost_fates"), result)
    assert result["trainer_bitwise_equal"] is True
    assert result["ok"] is True


def test_killing_everything_reaches_the_launcher_tree_and_what_names_the_run_dir_but_not_the_killer(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    launcher = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"])  # a launcher and its child
    while not psutil.Process(launcher.pid).children():
        time.sleep(0.05)
    tree = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
    sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
    server = subprocess.Popen([*sleeper, str(run_dir / "nats" / "nats-server.conf")])  # names the run dir
    bystander = subprocess.Popen([*sleeper, str(tmp_path / "run-other")])  # a prefix of it, not inside
    # The killer names the run dir on its own command line, as `gyre chaos --run-dir D` does.
    killer = subprocess.run(
        [sys.executable, "-c", "import sys; from pathlib import Path; from app.chaos_resume import "
         f"kill_everything; print(kill_everything({launcher.pid}, Path(sys.argv[1])))", str(run_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    try:
        assert killer.returncode == 0, killer.stderr  # it did not kill itself
        assert int(killer.stdout) == len(tree) + 1  # the launcher's tree and the server
        assert launcher.wait(30) == -9 and server.wait(30) == -9
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree)
        assert bystander.poll() is None
    finally:
        for p in (launcher, server, bystander):
            p.kill()
            p.wait()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(2500)
def test_a_run_whose_every_process_is_killed_resumes_its_live_executions_and_continues_its_step_count(
    tmp_path: Path,
) -> None:
    import yaml

    raw = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    raw["rollout"].update(longhorizon_min_turns=40, longhorizon_max_turns=48)  # executions live for seconds
    # A group of these executions (~6K tokens) fills a step's batch alone, so admission counts one group
    # per version (the quickstart's 4 are four short groups): otherwise the rollout runs 12 steps ahead,
    # the resumed run trains its last steps from that backlog, and the job ends before the executions it
    # resumed can finish.
    raw["rollout"]["groups_per_version"] = 1
    raw["job"]["timeout_s"] = 1800  # each of the two runs; the quickstart's 600 s is for an idle machine
    config = tmp_path / "long.yaml"
    config.write_text(yaml.safe_dump(raw))
    proc = run_chaos(
        [str(config), "--json", "--resume", "--steps", "12"] + ["--run-dir", str(tmp_path / "run")],
        tmp_path,
        timeout_s=2400,
    )
    assert proc.stdout.strip(), proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["processes_killed"] >= 6  # launcher, NATS, Postgres and the four services at least
    assert 1 <= result["step_at_kill"] < 12
    if not (result["completed"] is True and result["steps_continuous"] is True):
        # one string, not a tuple: pytest shortens a tuple's repr and hid the logs that say why
        tails = [
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
            for p in (tmp_path / "run.resume.log", tmp_path / "run" / "postgres" / "postgres.log")
            if p.is_file()
        ]
        keys = ("end_reason", "step_at_kill", "completed", "steps_continuous")
        pytest.fail("\n".join([str({k: result.get(k) for k in keys}), proc.stderr[-3000:], *tails]))
    assert result["final_step"] >= 12
    live = result["executions_live_at_kill"]
    assert live > 0, result  # the kill waits for executions live in the event log
    assert result["executions_resumed"] >= 0.95 * live, result  # resumed under their own ids, finished
    for counter in ("steps_lost", "paths_trained_twice", "batches_lost", "double_leases", "executions_lost"):
        assert result[counter] == 0, (counter, result.get("executions_lost_fates"), result)
    assert result["trainer_bitwise_equal"] is True
