"""`gyre chaos [CONFIG] [--json] [--steps N] [--seed S] [--run-dir D] [--targets T,..] [--resume|--soak]`:
kill anything, lose nothing.

Runs one job of CONFIG (default: the quickstart) exactly as `gyre run` does — every service its own
supervised process, embedded NATS and Postgres — and meanwhile, one fault at a time:

    for target in --targets (default scheduler, rollout, trajectory, trainer, nats, postgres; also
                  engine and nats-node, app.chaos_faults says what each kills and waits for):
        wait for trainer step s_target (spread over the run) + a random delay (seeded); a rollout
        or engine kill then also waits for a live execution (started, not ended)
        kill the target (SIGKILL; postgres: a fast shutdown; engine: SIGUSR2 to the rollout, whose
        rollout.fault_injection this command turns on; nats-node: the steps stream's leader of a
        3-node NATS cluster, which this command turns on)
        wait until it is back (the supervisor restarted it, or the rollout re-admitted a fresh
        engine) and every service reports SERVING                                  -> recovery_s
        wait until the trainer publishes its next weight version                     -> progress_resumed_s

`--soak [--kills N] [--stall-s T]` runs another scenario instead (app.chaos_soak): N kills (default
50) of random targets at random instants (seeded: 0.5-8 s apart, one pair < 1 s apart, one kill of
a service while it restarts, the trainer's kills aimed at a pull or a publish) over a run of
max(20, N) steps, with the launcher's restart budget raised to N + 5; it reports stalls, the
continuity of the weight versions, kills per target and the counters below.

`--resume` runs another scenario instead (app.chaos_resume): every process of a `gyre run` killed at
once mid-run, then `gyre run --resume` on the same run dir; the same counters, plus steps_continuous.

Then, over the whole run, from the event log (events.jsonl), the services' final counters and the
trainer's final checkpoint:

    steps_emitted        distinct step events on the bus (what every rollout incarnation published)
    steps_stored         calls the trajectory service holds in Postgres
    steps_lost           steps_emitted - steps_stored (floor 0)
    batches_lost         batches the trajectory service handed to the trainer (delivered, or acked as
                         trained) that the trainer's final model never trained, except one still in
                         flight when the job stopped (batches_dissolved: announced batches the
                         trajectory later released as stale or too big; their groups were re-packed
                         or dropped as stale, which the trajectory counts)
    paths_trained_twice  paths of batches the trainer trained more than once
    double_leases        a device acquired by a holder while another holder's lease was not released,
                         or with an epoch not above the previous acquisition's
    executions_lost      executions of a rollout process that died (killed here or exiting by itself;
                         started, no end event when it died) that the successor did not resume and
                         whose group was never scored: neither ended nor trained as partial
                         (executions_orphaned: all of them, scored or not; executions_lost_fates:
                         id -> fate of each lost one). One resumed and still running when the job
                         stopped is in flight, not lost (executions_resumed_unfinished)
    executions_live_at_kill / _resumed / _restarted   of those, the ones the restarted rollout resumed
                         under their own id and finished (RESUMED event, then FINISHED or TRUNCATED),
                         and the ones it ended FAILED instead (their tasks ran again in new groups);
                         executions_resumed_unfinished: resumed, still running when the job stopped;
                         executions_resumed_fraction = resumed / live at kill (execution_fates)
    engine_kill_executions_live / _finished / _lost   executions live when an engine was killed
                         (the rollout lived), the ones that finished (FINISHED or TRUNCATED) and the
                         ones that ended FAILED or never ended (engine_kill_fates)
    nats_steps_stored_per_node, nats_replicas_agree   after a nats-node kill: the steps stream's
                         messages in each node's own copy, and whether all agree (the restarted node
                         caught up)
    completed            the job reached its steps; `learned` (+ reward delta): the report's verdict
    trainer_bitwise_equal  the exactly-once probe (app.exactly_once): a trainer SIGKILLed and
                         restarted ends bitwise equal to an uninterrupted one fed the same batches

Exit status 0 when completed, every loss counter is 0, every fault recovered, the replicas agree
(after a nats-node kill) and the trainer is bitwise equal; 1 otherwise; 2 for a bad config.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.chaos_counts import (
    LOSS_COUNTERS,
    batch_states,
    count_double_leases,
    engine_kill_fates,
    execution_fates,
    final_trainer_state,
    tally,
)
from app.chaos_faults import DEFAULT_TARGETS, TARGETS, inject, plan_faults, replicas_caught_up
from gyre.errors import ConfigError

DEFAULT_CONFIG = Path("examples/quickstart.yaml")
# re-exported: the counting functions live in app.chaos_counts
__all__ = [
    "batch_states",
    "count_double_leases",
    "engine_kill_fates",
    "execution_fates",
    "final_trainer_state",
    "main",
    "plan_faults",
    "tally",
]


# -- the command -------------------------------------------------------------------------------


def run_chaos(
    config_path: Path, *, steps: int | None, seed: int, run_dir: Path | None, targets: list[str]
) -> dict[str, Any]:
    """Run the job with faults injected and return every number (module docstring)."""
    import yaml

    from app.exactly_once import run_probe
    from app.job.config import JobConfig
    from app.job.run import (
        CONFIG_NAME,
        drive,
        effective_config,
        finish_run,
        prepare_run_dir,
        service_wiring,
    )
    from app.launcher.deployment import Deployment
    from gyre.config import load_common, load_section

    raw = effective_config(config_path, policy=None, steps=steps, run_dir=run_dir)
    raw.setdefault("job", {})["timeout_s"] = max(float(raw["job"].get("timeout_s", 0)), 3600.0)
    if "engine" in targets:  # SIGUSR2 fails one engine of the rollout (app.chaos_faults)
        raw.setdefault("rollout", {})["fault_injection"] = True
    launcher = raw.setdefault("launcher", {})
    if "nats-node" in targets and int(launcher.get("nats_cluster_size", 1)) == 1:
        launcher["nats_cluster_size"] = 3  # a node of a replicated bus to kill
    if "nats" in targets and int(launcher.get("nats_cluster_size", 1)) > 1:
        raise ConfigError("target nats kills a single nats-server; on a NATS cluster use nats-node")
    common = load_common(data=raw)
    job = load_section(JobConfig, "job", data=raw)
    if job.num_steps < 4:
        raise ConfigError(f"gyre chaos needs at least 4 trainer steps (job.num_steps), got {job.num_steps}")
    out_dir = Path(common.run_dir).resolve()
    prepare_run_dir(out_dir)
    raw["run_dir"] = str(out_dir)
    effective = out_dir / CONFIG_NAME
    effective.write_text(yaml.safe_dump(raw, sort_keys=False))
    faults = plan_faults(targets, job.num_steps, random.Random(seed))

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    started = time.time()
    service_args, extra_env = service_wiring(raw)
    with Deployment(
        effective, run_dir=out_dir, service_args=service_args, extra_env=extra_env, on_progress=progress
    ) as dep:

        async def sidecar(tracker: Any) -> None:
            await inject(dep, tracker, faults)

        outcome = asyncio.run(drive(dep, common, job, out_dir, started=started, sidecar=sidecar))
        replicas = asyncio.run(replicas_caught_up(dep)) if "nats-node" in targets else {}
        try:
            in_store: dict[str, dict[str, Any]] | None = batch_states(
                dep.endpoints.database_url, common.run_id
            )
        except Exception as exc:  # reported: without it batches_lost cannot be judged
            progress(f"could not read the trajectory's batches: {exc!r}")
            in_store = None
    wall_s = time.time() - started
    report = finish_run(out_dir, outcome, wall_s=wall_s, seed=common.seed)
    counters = tally(out_dir, outcome.final_stats, faults, in_store)
    probe = run_probe(out_dir / "exactly_once", effective, steps=8, seed=seed)
    summary = report.summary
    result: dict[str, Any] = {
        "config": str(config_path),
        "run_dir": str(out_dir),
        "seed": seed,
        "num_steps": job.num_steps,
        "wall_s": round(wall_s, 1),
        "completed": outcome.reached_steps,
        "end_reason": outcome.reason,
        "faults": [asdict(f) for f in faults],
        "all_faults_recovered": all(f.recovered for f in faults),
        "nats_cluster_size": int(raw.get("launcher", {}).get("nats_cluster_size", 1)),
        **replicas,
        **counters,
        "restarts": outcome.final_stats.get("launcher", {}).get("restarts", {}),
        "learned": bool(summary.get("learned")),
        "reward_first20": summary.get("reward_first20"),
        "reward_last20": summary.get("reward_last20"),
        "reward_delta": summary.get("reward_delta"),
        "learned_rule": summary.get("learned_rule"),
        **probe,
    }
    result["ok"] = bool(
        result["completed"]
        and result["all_faults_recovered"]
        and all(result[c] == 0 for c in LOSS_COUNTERS)
        and result["trainer_bitwise_equal"]
        and result.get("nats_replicas_agree", True)
    )
    (out_dir / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def run_resume(config_path: Path, *, steps: int | None, seed: int, run_dir: Path) -> dict[str, Any]:
    """`gyre chaos --resume` (app.chaos_resume) plus the exactly-once probe; the result is also
    written to `<run_dir>/chaos.json`."""
    from app.chaos_resume import run_resume_chaos
    from app.exactly_once import run_probe
    from app.job.config import JobConfig
    from app.job.run import prepare_run_dir
    from gyre.config import load_common, load_section, load_yaml

    raw = load_yaml(config_path)
    num_steps = steps or load_section(JobConfig, "job", data=raw).num_steps
    if num_steps < 4:
        raise ConfigError(f"gyre chaos --resume needs at least 4 trainer steps, got {num_steps}")
    out_dir = run_dir.resolve()
    prepare_run_dir(out_dir)
    run_id = load_common(data=raw).run_id
    result = {
        "config": str(config_path),
        "run_dir": str(out_dir),
        "seed": seed,
        "num_steps": num_steps,
        **run_resume_chaos(config_path, steps=num_steps, seed=seed, run_dir=out_dir, run_id=run_id),
    }
    result.update(run_probe(out_dir / "exactly_once", out_dir / "config.yaml", steps=8, seed=seed))
    result["ok"] = bool(
        result["completed"]
        and result["steps_continuous"]
        and all(result[c] == 0 for c in LOSS_COUNTERS)
        and result["trainer_bitwise_equal"]
    )
    (out_dir / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _print_text(result: dict[str, Any]) -> None:
    print(f"gyre chaos: {result['config']} ({result['num_steps']} steps, seed {result['seed']})")
    for f in result["faults"]:
        state = f"recovered in {f['recovery_s']} s" if f["recovered"] else f"NOT recovered ({f['error']})"
        print(
            f"  kill {f['target']:<10} after step {f['step_at_kill']:>3}: {state}; "
            f"progress resumed after {f['progress_resumed_s']} s; restarted {f['restarts']}"
        )
    for key in (
        "completed",
        "steps_emitted",
        "steps_stored",
        "executions_live_at_kill",
        "executions_resumed",
        "executions_restarted",
        "engine_kill_executions_live",
        "engine_kill_executions_finished",
        *LOSS_COUNTERS,
        "learned",
        "trainer_bitwise_equal",
    ):
        print(f"  {key}: {result[key]}")
    print(f"  ok: {result['ok']}  (details: {result['run_dir']}/chaos.json)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gyre chaos", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument(
        "config", type=Path, nargs="?", default=DEFAULT_CONFIG, help="run YAML (default: quickstart)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--steps", type=int, help="trainer steps (overrides job.num_steps)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault points and delays")
    parser.add_argument(
        "--run-dir", type=Path, help="run directory (default: the config's run_dir + '-chaos')"
    )
    parser.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=(
            f"comma-separated faults, in order, of {','.join(TARGETS)} (default {','.join(DEFAULT_TARGETS)}; "
            "engine turns rollout.fault_injection on, nats-node runs NATS as a 3-node cluster)"
        ),
    )
    parser.add_argument(
        "--soak",
        action="store_true",
        help="instead of one fault per target: --kills random kills at random instants over a long run, "
        "then check for stalls and losses (app/chaos_soak.py)",
    )
    parser.add_argument("--kills", type=int, default=50, help="--soak: how many kills (default 50)")
    parser.add_argument(
        "--stall-s",
        type=float,
        default=300.0,
        help="--soak: no new weight version for this long ends the job as stalled (default 300)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="instead of single faults: kill every process of a `gyre run` mid-run, then `gyre run --resume` "
        "it on the same run dir (app/chaos_resume.py)",
    )
    args = parser.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        print(f"gyre chaos: unknown target(s) {unknown}; choose from {list(TARGETS)}", file=sys.stderr)
        return 2
    run_dir = args.run_dir
    if run_dir is None:
        from gyre.config import load_common, load_yaml

        try:
            run_dir = Path(f"{load_common(data=load_yaml(args.config)).run_dir}-chaos")
        except (ConfigError, OSError) as exc:
            print(f"gyre chaos: {exc}", file=sys.stderr)
            return 2
    try:
        # stdout carries only the result: the job's progress lines go to stderr meanwhile.
        with contextlib.redirect_stdout(sys.stderr):
            if args.soak:
                from app.chaos_soak import run_soak

                result = run_soak(
                    args.config,
                    num_kills=args.kills,
                    steps=args.steps,
                    seed=args.seed,
                    run_dir=run_dir,
                    stall_s=args.stall_s,
                )
            elif args.resume:
                result = run_resume(args.config, steps=args.steps, seed=args.seed, run_dir=run_dir)
            else:
                result = run_chaos(
                    args.config, steps=args.steps, seed=args.seed, run_dir=run_dir, targets=targets
                )
    except ConfigError as exc:
        print(f"gyre chaos: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.soak:
        from app.chaos_soak import print_soak

        print_soak(result)
    elif args.resume:
        keys = ("completed", "step_at_kill", "final_step", "steps_continuous", "processes_killed")
        live = ("executions_live_at_kill", "executions_resumed", "executions_restarted")
        for key in (*keys, *live, "executions_resumed_unfinished"):
            print(f"  {key}: {result[key]}")
        for key in (*LOSS_COUNTERS, "trainer_bitwise_equal", "ok"):
            print(f"  {key}: {result.get(key)}")
    else:
        _print_text(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
