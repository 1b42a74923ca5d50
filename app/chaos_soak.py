"""`gyre chaos --soak [CONFIG] [--kills N] [--seed S] [--json]`: many kills at random instants over a
long run, then check that nothing was lost and the job never stalled.

One job of CONFIG (default: the quickstart) runs exactly as `gyre run` runs it, with
`job.num_steps` = max(20, N) unless --steps says otherwise, and beside it (seeded, `plan_soak`):

    for kill in 1..N:
        sleep a random delay of 0.5-8 s (wall time, since the previous kill)
        pick a target: scheduler, rollout, trajectory, trainer, nats, postgres or engine
        wait until it has a process (one in its restart backoff has none: a kill needs a victim);
        a rollout kill also waits (up to app.chaos_faults.LIVE_WAIT_S) for live executions, an engine
        kill for a torch engine holding requests, as `gyre chaos` does
        aimed kinds of kill, besides "random":
            close       0.1-0.9 s after the previous kill, another target (two kills < 1 s apart;
                        one that has a process then, not one waited for)
            recovering  the previous (service) target's new process while it starts, before it
                        reports SERVING (a kill during recovery)
            pull        the trainer 0.02-0.3 s after it published a version: in the pull of the
                        next batch (or the acks and checkpoint before it)
            publish     the trainer once the next version's weights file is on disk and its event
                        not yet seen: in the middle of the publish
        kill it as app.chaos_faults does (SIGKILL; postgres: a fast shutdown; engine: SIGUSR2 to the
        rollout, whose `rollout.fault_injection` this command turns on)
    then wait until every killed target is back and every service SERVING, and for one more weight
    version (the job must not stop in the middle of the last recovery), and for the job's steps
    meanwhile: no new weight version for `--stall-s` (default 300 s) ends the job as stalled

The launcher's restart budget (`launcher.max_restarts`, counted per service over
`launcher.restart_window_s`) is raised to N + 5, since a soak kills one service many times in a
window, and its backoff is capped at `SOAK_BACKOFF_MAX_S` so the kills, not the doubling backoff,
pace the run. Then, over the run, what `gyre chaos` counts (app.chaos_counts.tally, each
rollout kill a rollout death, each engine kill an engine death), plus:

    kills_per_target        kills made, per target; restarts_per_target: the supervisor's restarts
                            (a kill that reached a process is one restart; a Postgres restart
                            also restarts the services whose pool broke)
    kills_confirmed         kills followed by a restart of their target (engine: by one more engine
                            restart of the same rollout process, or by the rollout's own restart)
    close_kills_s           gap between the two kills of each "close" pair
    kills_during_recovery   kills made while the previous kill's target was not back (SERVING)
    trainer_aims            for each aimed trainer kill, whether it hit its moment (publish: the next
                            version's file existed and its event was not yet seen)
    versions_published      distinct weight versions; steps_continuous: they are 1..max, max >=
                            num_steps, increasing in publication time, none published twice with
                            different bytes (versions_republished counts identical re-publishes)
    longest_version_gap_s   the longest wait between two consecutive versions (and after which)
    stalls                  gaps longer than --stall-s, plus 1 when the job did not reach its steps
    executions_live_at_kills / executions_resumed    executions live when a rollout died / resumed
    wall_s                  the job's wall time (the exactly-once probe after it not included)

`ok` only if the job completed, every kill was made and confirmed, stalls 0, steps continuous,
every loss counter 0 and the exactly-once probe bitwise equal.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.chaos_faults import (
    LIVE_WAIT_S,
    Fault,
    engine_recovered,
    inject_engine_fault,
    kill_target,
    rollout_status,
    until,
)
from gyre.errors import ConfigError, GyreError

SERVICES = ("scheduler", "rollout", "trajectory", "trainer")
SOAK_TARGETS = (*SERVICES, "nats", "postgres", "engine")
DELAY_S = (0.5, 8.0)  # random wall-time delay between two kills
CLOSE_S = (0.1, 0.9)  # the delay of a "close" kill
PULL_AFTER_S = (0.02, 0.3)  # an aimed "pull" kill: this long after a new version was seen
SOAK_BACKOFF_MAX_S = 4.0  # the launcher's restart backoff cap during a soak
STALL_S = 300.0  # no new weight version for this long: the soak ends the job as stalled
TARGET_WAIT_S = 180.0  # longest wait for a target to have a process (or a trainer moment)
ENGINE_RECOVERY_S = 120.0
SETTLE_S = 600.0  # longest wait, after the last kill, for every target back and one more version
MIN_KILLS = 4  # room for a close pair and a kill during recovery apart from each other


class SoakStalled(GyreError):
    """No weight version for longer than the stall bound: the soak ended the job."""


@dataclass
class Kill:
    """One kill of the soak (times: Unix seconds)."""

    index: int
    target: str  # one of SOAK_TARGETS
    how: str  # random | close | recovering | pull | publish (module docstring)
    delay_s: float  # wall time after the previous kill, before its moment is waited for
    offset_s: float = 0.0  # pull: after the next version was seen
    alternates: tuple[str, ...] = ()  # close: the targets to kill instead if this one has no process
    injected_at: float = 0.0
    step_at_kill: int = 0
    pid: int | None = None  # the process signalled
    live_executions: int = 0  # at the kill: the rollout's live executions (rollout kill), else the
    # executions started and not ended in the event log (which lags the rollout by its tail)
    previous_back: bool | None = None  # was the previous kill's target back (SERVING) at this kill?
    aim_hit: bool | None = None  # pull / publish / recovering: did it hit its moment?
    confirmed: bool = False  # a restart of its target followed (engine: an engine restart)
    recovery_s: float | None = None  # kill -> its target serving again
    detail: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def plan_soak(num_kills: int, rng: random.Random, targets: tuple[str, ...] = SOAK_TARGETS) -> list[Kill]:
    """The kills, seeded: random targets and delays, one close pair, one kill during the recovery of
    a service, and the trainer's kills aimed at a pull or a publish as often as left random."""
    if num_kills < MIN_KILLS:
        raise ConfigError(f"gyre chaos --soak needs at least {MIN_KILLS} kills, got {num_kills}")
    close_at = rng.randrange(1, num_kills - 2)
    recovering_at = rng.randrange(close_at + 2, num_kills)
    kills: list[Kill] = []
    for i in range(num_kills):
        target = rng.choice(targets)
        how = rng.choice(("random", "pull", "publish")) if target == "trainer" else "random"
        delay = round(rng.uniform(*DELAY_S), 2)
        alternates: tuple[str, ...] = ()
        if i == close_at:
            others = [t for t in targets if t not in (kills[-1].target, "engine")]
            rng.shuffle(others)
            target, alternates = others[0], tuple(others[1:])
            how, delay = "close", round(rng.uniform(*CLOSE_S), 2)
        elif i == recovering_at:
            if kills[-1].target not in SERVICES:  # a service's start can be caught before SERVING
                kills[-1].target, kills[-1].how = rng.choice(SERVICES), "random"
            target, how, delay = kills[-1].target, "recovering", 0.0
        offset = round(rng.uniform(*PULL_AFTER_S), 2) if how == "pull" else 0.0
        kills.append(Kill(i, target, how, delay, offset, alternates))
    return kills


# -- making the kills ------------------------------------------------------------------------


def _restart_of(deployment: Any, target: str, since: float) -> Any:
    """The first restart record of `target` seen exiting after `since` and serving again, else None."""
    return next(
        (r for r in deployment.restarts if r.service == target and r.exited_at >= since and r.serving_at),
        None,
    )


def _has_victim(deployment: Any, target: str) -> bool:
    if target in ("nats", "postgres"):
        server = deployment.embedded(target)
        return server is not None and getattr(server, "pid", None) is not None
    proc = deployment.process("rollout" if target == "engine" else target)
    return proc is not None and proc.returncode is None


def _back(deployment: Any, kill: Kill) -> bool | None:
    """Whether `kill`'s target is back: restarted and serving (engine: not judged here, None)."""
    if kill.target == "engine" or not kill.injected_at:
        return None
    return _restart_of(deployment, kill.target, kill.injected_at - 1.0) is not None


async def _aim(deployment: Any, tracker: Any, kill: Kill, previous: Kill | None, run_dir: Path) -> None:
    """Wait for `kill`'s moment (module docstring); sets aim_hit where it has one."""
    await asyncio.sleep(kill.delay_s)
    if kill.how == "recovering" and previous is not None and previous.pid is not None:

        def starting() -> bool:
            proc = deployment.process(kill.target)
            return bool(proc is not None and proc.returncode is None and proc.pid != previous.pid)

        found = await until(starting, time.time() + TARGET_WAIT_S, 0.02)
        kill.aim_hit = found and not _back(deployment, previous)
    elif kill.how == "pull":
        seen = tracker.version
        await until(lambda: tracker.version > seen, time.time() + TARGET_WAIT_S, 0.02)
        await asyncio.sleep(kill.offset_s)
        kill.aim_hit = tracker.version > seen
    elif kill.how == "publish":
        weights = run_dir / "weights"

        def written() -> bool:
            nxt = weights / f"v{tracker.version + 1:06d}.safetensors"
            return nxt.is_file()

        kill.aim_hit = await until(written, time.time() + TARGET_WAIT_S, 0.005)
        kill.detail["version_file"] = tracker.version + 1


async def _rollout_live(deployment: Any, kill: Kill) -> bool:
    """Whether the rollout reports live executions (their number -> kill.live_executions)."""
    try:
        kill.live_executions = int((await rollout_status(deployment)).live_executions)
    except Exception:  # not serving yet: asked again
        return False
    return kill.live_executions > 0


async def _retrying(call: Any) -> Any:
    """`await call()` again while it raises (a rollout restarting answers no status), up to
    TARGET_WAIT_S."""
    deadline = time.time() + TARGET_WAIT_S
    while True:
        try:
            return await call()
        except Exception:
            if time.time() > deadline:
                raise
            await asyncio.sleep(0.5)


async def _make(deployment: Any, tracker: Any, kill: Kill, previous: Kill | None, run_dir: Path) -> Any:
    """Wait for the moment and a victim, then kill; returns the engine status before an engine kill."""
    await _aim(deployment, tracker, kill, previous, run_dir)
    if kill.how == "close" and not _has_victim(deployment, kill.target):  # no time to wait for one
        ready = [t for t in kill.alternates if _has_victim(deployment, t)]
        kill.detail["planned_target"] = kill.target
        kill.target = ready[0] if ready else kill.target
    if not await until(lambda: _has_victim(deployment, kill.target), time.time() + TARGET_WAIT_S, 0.05):
        raise GyreError(f"{kill.target} had no process to kill for {TARGET_WAIT_S:.0f} s")
    if (
        kill.target == "rollout" and kill.how != "close"
    ):  # as gyre chaos does: a rollout kill is worth most with executions live
        await until(lambda: _rollout_live(deployment, kill), time.time() + LIVE_WAIT_S, 0.1)
    if kill.how == "publish":  # the event may have arrived while we waited for the victim
        kill.aim_hit = bool(kill.aim_hit) and tracker.version < kill.detail["version_file"]
    kill.previous_back = None if previous is None else _back(deployment, previous)
    kill.step_at_kill = tracker.version
    if kill.target != "rollout":  # the event log's count (it lags the rollout by its tail)
        kill.live_executions = tracker.executions["started"] - tracker.executions["ended"]
    if kill.target == "engine":
        fault = Fault("engine", tracker.version, 0.0)
        before = await _retrying(lambda: inject_engine_fault(deployment, fault))
        kill.injected_at, kill.pid, kill.detail = fault.injected_at, fault.detail["rollout_pid"], fault.detail
        kill.live_executions = tracker.executions["started"] - tracker.executions["ended"]
        return before
    if kill.target in ("nats", "postgres"):
        kill.pid = deployment.embedded(kill.target).pid
    else:
        kill.pid = deployment.process(kill.target).pid
    kill_target(deployment, kill.target)
    kill.injected_at = time.time()
    return None


async def _watch_engine(deployment: Any, kill: Kill, before: Any) -> None:
    """Confirm an engine kill: one more engine restart of the same rollout (or the rollout restarted,
    which ends every engine of it anyway)."""
    fault = Fault("engine", kill.step_at_kill, 0.0, injected_at=kill.injected_at, detail=kill.detail)

    async def recovered() -> bool:
        if _restart_of(deployment, "rollout", kill.injected_at) is not None:
            kill.detail["rollout_restarted"] = True
            return True
        try:
            return await engine_recovered(deployment, fault, before)
        except Exception:  # the rollout is being restarted: asked again on the next poll
            return False

    if await until(recovered, kill.injected_at + ENGINE_RECOVERY_S, 0.2):
        kill.confirmed = True
        kill.recovery_s = round(time.time() - kill.injected_at, 2)


async def settle(deployment: Any, tracker: Any, kills: list[Kill]) -> None:
    """After the last kill: wait until every killed target is back and every service SERVING, then for
    one more weight version, so that the job does not stop in the middle of the last recovery (a
    rollout not yet back has not resumed its executions; a trainer not yet back has not trained the
    batch it held). Bounded by SETTLE_S; what is still not back is reported unconfirmed."""
    from app.chaos_faults import all_serving

    def back() -> bool:
        return all(_back(deployment, k) is not False for k in kills) and all_serving(deployment)

    deadline = time.time() + SETTLE_S
    await until(lambda: asyncio.to_thread(back), deadline, 0.5)
    version = tracker.version
    await until(lambda: tracker.version > version, deadline, 0.5)


async def soak(
    deployment: Any, tracker: Any, kills: list[Kill], run_dir: Path, stall_s: float = STALL_S
) -> None:
    """Make `kills` one after the other, then wait for the job's steps; raises SoakStalled once no
    weight version came for `stall_s` (the job then ends)."""
    watchers: list[asyncio.Task[None]] = []

    async def killing() -> None:
        previous: Kill | None = None
        for kill in kills:
            try:
                before = await _make(deployment, tracker, kill, previous, run_dir)
                if kill.target == "engine" and before is not None:
                    watchers.append(asyncio.create_task(_watch_engine(deployment, kill, before)))
                print(
                    f"  soak kill {kill.index + 1}/{len(kills)}: {kill.target} ({kill.how}) at step "
                    f"{kill.step_at_kill}, {kill.live_executions} executions live",
                    file=sys.stderr,
                    flush=True,
                )
            except Exception as exc:  # recorded and reported; the next kill still runs
                kill.error = repr(exc)
            previous = kill if kill.injected_at else previous

    async def watching() -> None:
        version, since = tracker.version, time.monotonic()
        while True:
            if tracker.version != version:
                version, since = tracker.version, time.monotonic()
            if time.monotonic() - since > stall_s:
                raise SoakStalled(f"stalled: no weight version after {version} for {stall_s:.0f} s")
            await asyncio.sleep(0.5)

    async def finishing() -> None:
        await killing()
        await asyncio.gather(*watchers)
        await settle(deployment, tracker, kills)
        await tracker.steps_done.wait()

    watch = asyncio.create_task(watching())
    work = asyncio.create_task(finishing())
    try:
        await asyncio.wait({watch, work}, return_when=asyncio.FIRST_COMPLETED)
        if watch.done():
            watch.result()  # raises SoakStalled: the kills stop, the job ends
        work.result()
    finally:
        for task in (watch, work, *watchers):
            task.cancel()


# -- judging the run -------------------------------------------------------------------------


def version_history(events_path: Path, num_steps: int, stall_s: float, started: float) -> dict[str, Any]:
    """Continuity of the weight versions in the event log and the gaps between them."""
    from app.job.eventlog import read_events

    first: dict[int, tuple[float, str]] = {}
    republished = 0
    conflicting = 0
    for record in read_events(events_path):
        if record["type"] != "WeightsPublishedEvent":
            continue
        w = record["event"].get("weights", {})
        v, at, sha = int(w.get("version", 0)), float(w.get("created_unix_s", 0)), str(w.get("sha256", ""))
        if v in first:
            republished += 1
            conflicting += first[v][1] != sha
        else:
            first[v] = (at, sha)
    ordered = sorted(first, key=lambda v: first[v][0])
    times = [started] + [first[v][0] for v in ordered]
    gaps = [(times[i + 1] - times[i], ordered[i - 1] if i else 0) for i in range(len(ordered))]
    longest = max(gaps, default=(0.0, 0))
    top = max(first, default=0)
    return {
        "versions_published": len(first),
        "final_version": top,
        "versions_republished": republished,
        "versions_conflicting": conflicting,
        "steps_continuous": bool(first)
        and sorted(first) == list(range(1, top + 1))
        and ordered == sorted(ordered)
        and top >= num_steps
        and conflicting == 0,
        # between consecutive versions (the first from the job's start, startup included)
        "longest_version_gap_s": round(longest[0], 1),
        "longest_version_gap_after": longest[1],
        "version_gaps_over_stall": sum(1 for g, after in gaps if g > stall_s and after > 0),
    }


def judge_kills(kills: list[Kill], deployment: Any) -> None:
    """Confirm each non-engine kill by its target's restart and fill its recovery_s."""
    for kill in kills:
        if kill.target == "engine" or not kill.injected_at:
            continue
        record = _restart_of(deployment, kill.target, kill.injected_at - 1.0)
        if record is not None:
            kill.confirmed = True
            kill.recovery_s = round(record.serving_at - kill.injected_at, 2)


def summarise_kills(kills: list[Kill], restarts: dict[str, int]) -> dict[str, Any]:
    made = [k for k in kills if k.injected_at]
    close = [
        round(b.injected_at - a.injected_at, 2)
        for a, b in zip(made, made[1:], strict=False)
        if b.how == "close"
    ]
    return {
        "kills_planned": len(kills),
        "kills_made": len(made),
        "kills_per_target": dict(Counter(k.target for k in made)),
        "restarts_per_target": restarts,
        "kills_confirmed": sum(k.confirmed for k in made),
        "kills_by_kind": dict(Counter(k.how for k in made)),
        "close_kills_s": close,
        "kills_during_recovery": sum(1 for k in made if k.previous_back is False),
        "trainer_aims": {
            how: [k.aim_hit for k in made if k.how == how and k.target == "trainer"]
            for how in ("pull", "publish")
        },
        "recovering_kill_hit": [k.aim_hit for k in made if k.how == "recovering"],
        "longest_recovery_s": max((k.recovery_s or 0.0 for k in made), default=0.0),
        "kill_errors": {k.index: k.error for k in kills if k.error},
    }


# -- the command -----------------------------------------------------------------------------


def soak_config(raw: dict[str, Any], num_kills: int, steps: int | None) -> dict[str, Any]:
    """The run YAML with what a soak needs: the steps, the restart budget, engine faults on."""
    job = raw.setdefault("job", {})
    if steps is None:
        job["num_steps"] = max(20, num_kills)
    job["timeout_s"] = max(float(job.get("timeout_s", 0)), 3600.0)
    launcher = raw.setdefault("launcher", {})
    if int(launcher.get("nats_cluster_size", 1)) > 1:
        raise ConfigError("gyre chaos --soak kills a single nats-server; run it with nats_cluster_size 1")
    launcher["max_restarts"] = max(int(launcher.get("max_restarts", 5)), num_kills + 5)
    launcher["restart_backoff_max_s"] = min(
        float(launcher.get("restart_backoff_max_s", 30.0)), SOAK_BACKOFF_MAX_S
    )
    raw.setdefault("rollout", {})["fault_injection"] = True  # the engine target (app.chaos_faults)
    return raw


def run_soak(
    config_path: Path,
    *,
    num_kills: int,
    steps: int | None,
    seed: int,
    run_dir: Path | None,
    stall_s: float = STALL_S,
    probe: bool = True,
) -> dict[str, Any]:
    """Run the soak (module docstring) and return every number; also `<run_dir>/chaos.json`."""
    import yaml

    from app.chaos_counts import LOSS_COUNTERS, batch_states, tally
    from app.job.config import JobConfig
    from app.job.run import (
        CONFIG_NAME,
        JobOutcome,
        collect_final_stats,
        drive,
        effective_config,
        finish_run,
        prepare_run_dir,
        service_wiring,
    )
    from app.launcher.deployment import Deployment
    from gyre.config import load_common, load_section

    raw = soak_config(
        effective_config(config_path, policy=None, steps=steps, run_dir=run_dir), num_kills, steps
    )
    common = load_common(data=raw)
    job = load_section(JobConfig, "job", data=raw)
    kills = plan_soak(num_kills, random.Random(seed))
    out_dir = Path(common.run_dir).resolve()
    prepare_run_dir(out_dir)
    raw["run_dir"] = str(out_dir)
    effective = out_dir / CONFIG_NAME
    effective.write_text(yaml.safe_dump(raw, sort_keys=False))

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    started = time.time()
    service_args, extra_env = service_wiring(raw)
    with Deployment(
        effective, run_dir=out_dir, service_args=service_args, extra_env=extra_env, on_progress=progress
    ) as dep:

        async def sidecar(tracker: Any) -> None:
            await soak(dep, tracker, kills, out_dir, stall_s)

        try:
            outcome = asyncio.run(drive(dep, common, job, out_dir, started=started, sidecar=sidecar))
        except SoakStalled as exc:  # drive re-raised it after its final sweep of the event log
            stats = asyncio.run(collect_final_stats(dep.endpoints, common.run_id))
            outcome = JobOutcome(False, str(exc), {**stats, "launcher": dep.supervision_stats()})
        judge_kills(kills, dep)
        try:
            in_store: dict[str, dict[str, Any]] | None = batch_states(
                dep.endpoints.database_url, common.run_id
            )
        except Exception as exc:  # reported: without it batches_lost cannot be judged
            progress(f"could not read the trajectory's batches: {exc!r}")
            in_store = None
    wall_s = time.time() - started
    faults = [Fault(k.target, k.step_at_kill, k.delay_s, injected_at=k.injected_at) for k in kills]
    counters = tally(out_dir, outcome.final_stats, faults, in_store)
    history = version_history(out_dir / "events.jsonl", job.num_steps, stall_s, started)
    restarts = dict(outcome.final_stats.get("launcher", {}).get("restarts", {}))
    result: dict[str, Any] = {
        "mode": "soak",
        "config": str(config_path),
        "run_dir": str(out_dir),
        "seed": seed,
        "num_steps": job.num_steps,
        "wall_s": round(wall_s, 1),
        "completed": outcome.reached_steps,
        "end_reason": outcome.reason,
        "stall_s": stall_s,
        "max_restarts": raw["launcher"]["max_restarts"],
        **summarise_kills(kills, restarts),
        **history,
        "stalls": history["version_gaps_over_stall"] + (0 if outcome.reached_steps else 1),
        **counters,
        "executions_live_at_kills": counters["executions_live_at_kill"],
        "kills": [asdict(k) for k in kills],
    }
    # The counters are kept before anything else can fail: a long soak is not run twice for them.
    (out_dir / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        report = finish_run(out_dir, outcome, wall_s=wall_s, seed=common.seed)
        result["learned"] = bool(report.summary.get("learned"))
    except Exception as exc:  # reported: the report is not what the soak judges
        result["learned"], result["report_error"] = None, repr(exc)
    if probe:
        from app.exactly_once import run_probe

        try:
            result.update(run_probe(out_dir / "exactly_once", effective, steps=8, seed=seed))
        except Exception as exc:  # reported, and not ok: the trainer was not shown bitwise equal
            result["trainer_bitwise_equal"], result["probe_error"] = None, repr(exc)
    result["ok"] = bool(
        result["completed"]
        and result["kills_made"] == num_kills
        and result["kills_confirmed"] == num_kills
        and result["stalls"] == 0
        and result["steps_continuous"]
        and all(result[c] == 0 for c in LOSS_COUNTERS)
        and result.get("trainer_bitwise_equal", True)
    )
    (out_dir / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def print_soak(result: dict[str, Any]) -> None:
    """The soak's result as text (`gyre chaos --soak` without --json)."""
    print(f"gyre chaos --soak: {result['config']} ({result['num_steps']} steps, seed {result['seed']})")
    for key in (
        "completed",
        "end_reason",
        "wall_s",
        "kills_made",
        "kills_per_target",
        "restarts_per_target",
        "kills_confirmed",
        "kills_by_kind",
        "close_kills_s",
        "kills_during_recovery",
        "trainer_aims",
        "stalls",
        "longest_version_gap_s",
        "steps_continuous",
        "executions_live_at_kills",
        "executions_resumed",
        "steps_lost",
        "paths_trained_twice",
        "batches_lost",
        "double_leases",
        "executions_lost",
        "engine_kill_executions_lost",
        "trainer_bitwise_equal",
    ):
        print(f"  {key}: {result.get(key)}")
    print(f"  ok: {result['ok']}  (details: {result['run_dir']}/chaos.json)")


__all__ = ["Kill", "SoakStalled", "plan_soak", "print_soak", "run_soak", "soak", "version_history"]
