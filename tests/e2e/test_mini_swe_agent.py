"""End to end: `gyre run examples/mini_swe_agent/config.yaml` - mini-swe-agent (PyPI, unmodified; its
own `mini` entry point with its own yaml config) launched by the rollout service once per execution in
a sandboxed workspace, with real NATS, Postgres, gRPC, the four service processes, the torch engine
and the Megatron trainer. The model is the tiny byte-tokenizer GPT, so mini-swe-agent answers every
reply with its format error until its step limit; its calls still train.

Shows: every launch is one execution whose calls (exactly mini.yaml's step limit of them) are
call_seq 0..n-1 of that execution, their prompts written by mini-swe-agent (its system template,
then its format-error or observation messages); the workspace's hidden tests score each execution;
the calls are stored as trees (the group's shared prefixes once: fewer batched tokens than flat
paths); every group whose executions all ended before the last trainer step is scored, and its
paths are trained over at least the requested number of trainer steps. NATS and Postgres are the
test session's servers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app.job.eventlog import read_events
from gyre import tokenizer
from gyre.bus import subjects
from gyre.v1 import events_pb2
from tests.helpers.stream import expanded_prompts, read_stream

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "mini_swe_agent"
GYRE = [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())"]
STEPS = 2


def test_unmodified_mini_swe_agent_runs_one_execution_per_launch_scored_by_the_workspace_and_trained(
    nats_url: str, database_url: str, tmp_path: Path
) -> None:
    if importlib.util.find_spec("minisweagent") is None:  # not imported here: it writes its config dir
        pytest.skip("mini-swe-agent is in the `dev` extra: pip install -e .[dev]")
    mini_cfg = yaml.safe_load((EXAMPLE / "mini.yaml").read_text())
    step_limit = int(mini_cfg["agent"]["step_limit"])
    run_cfg = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    group_size = int(run_cfg["rollout"]["group_size"])
    lines = (EXAMPLE / "tasks.jsonl").read_text().splitlines()
    tasks = {t["task_id"]: t for t in (json.loads(line) for line in lines if line.strip())}

    run_dir = tmp_path / "swe"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    run_id = f"swe-{tmp_path.name}"[:60]
    env.update(GYRE_NATS_URL=nats_url, GYRE_DATABASE_URL=database_url, GYRE_RUN_ID=run_id)
    proc = subprocess.run(
        [*GYRE, "run", str(EXAMPLE / "config.yaml"), "--steps", str(STEPS), "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"gyre run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    records = read_events(run_dir / "events.jsonl")
    events: dict[str, list[dict]] = {}
    for r in records:
        events.setdefault(r["type"], []).append(r["event"])
    launched = {e["execution_id"] for e in events["ExecutionEvent"] if e.get("kind") == "KIND_STARTED"}
    ended = {e["execution_id"]: e for e in events["ExecutionEvent"] if e.get("kind") != "KIND_STARTED"}
    steps = read_stream(nats_url, subjects.steps(run_id, "*"), events_pb2.StepEvent, len(events["StepEvent"]))
    calls: dict[str, list[events_pb2.StepEvent]] = {}
    for step in steps:
        calls.setdefault(step.execution_id, []).append(step)

    # one execution per launch; mini-swe-agent exits 0 at its step limit: FINISHED with that many calls
    assert launched and set(calls) <= launched
    finished = [x for x, e in ended.items() if e.get("kind") == "KIND_FINISHED"]
    assert finished, {x: e.get("error", "")[-500:] for x, e in ended.items()}
    for x in finished:
        seqs = sorted(c.call_seq for c in calls[x])
        assert seqs == list(range(int(ended[x]["num_calls"]))) == list(range(step_limit)), (x, seqs)
        assert {c.group_id for c in calls[x]} == {ended[x]["group_id"]}
        # the prompts are mini-swe-agent's: its system template and the task's issue first, then the
        # reply it gives to each model answer (its format error, or the observation of a command run)
        # (calls after the first travel compact: their prompts are rebuilt as the services do)
        by_seq = {seq: tokenizer.decode(ids) for seq, ids in expanded_prompts(calls[x]).items()}
        task = tasks[ended[x]["task_id"]]
        assert "mswea_bash_command" in by_seq[0] and f"Issue: {task['spec']}" in by_seq[0], by_seq[0]
        for seq in range(1, step_limit):
            replies = by_seq[seq].count("Format error: Expected exactly 1 action") + by_seq[seq].count(
                "<returncode>"
            )
            assert replies == seq, (x, seq, by_seq[seq][-800:])
        # scored by the workspace's hidden tests (3 per task): the reward is a fraction of them
        reward = float(ended[x].get("reward", 0.0))
        assert 0.0 <= reward <= 1.0 and abs(reward * 3 - round(reward * 3)) < 1e-6, reward
        assert reward == pytest.approx(float(ended[x]["progress"].get("tests_passed_fraction", 0.0)))

    # the trees: every launch and call stored; each group's shared prefixes stored and trained once
    stats = json.loads((run_dir / "final_stats.json").read_text())["trajectory"]["values"]
    assert int(stats["executions"]) == len(launched)
    assert int(stats["stored_calls"]) == len(steps) > 0
    assert int(stats["stored_nodes"]) > 0
    assert 0 < int(stats["batched_tokens"]) < int(stats["batched_flat_tokens"]), stats

    # every group that ended before the last trainer step is scored; its paths were trained
    weights = events["WeightsPublishedEvent"]
    assert len(weights) >= STEPS
    last_weights = max(r["recv_unix_s"] for r in records if r["type"] == "WeightsPublishedEvent")
    done_at: dict[str, list[float]] = {}
    for r in records:
        if r["type"] == "ExecutionEvent" and r["event"].get("kind") != "KIND_STARTED":
            done_at.setdefault(r["event"]["group_id"], []).append(r["recv_unix_s"])
    complete = {g for g, ts in done_at.items() if len(ts) == group_size and max(ts) < last_weights}
    scored = {e["group_id"] for e in events.get("GroupScoredEvent", [])}
    assert complete and complete <= scored, (complete, scored)
    trained_paths = sum(int(float(e.get("metrics", {}).get("num_paths", 0))) for e in weights)
    scored_paths = sum(int(e.get("num_paths", 0)) for e in events["GroupScoredEvent"])
    assert 0 < trained_paths <= scored_paths

    print(
        f"mini-swe-agent: launched {len(launched)} executions, {len(finished)} finished with "
        f"{step_limit} calls each; {len(steps)} calls stored as {int(stats['stored_nodes'])} tree nodes; "
        f"batched {int(stats['batched_tokens'])} tree tokens for {int(stats['batched_flat_tokens'])} "
        f"flat; groups complete {len(complete)}, scored {len(scored)}; paths trained {trained_paths} of "
        f"{scored_paths} scored over {len(weights)} trainer steps"
    )
