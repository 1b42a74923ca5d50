"""`gyre bench elastic`: colocate, async and elastic measured side by side on paced devices, each next to
the simulator's prediction for the same workload file.

    gyre bench elastic --json
    gyre bench elastic --workload-file examples/workloads/paced_longtail.yaml --time-scale 20 --json

For each policy (same workload file, same seed) it runs the real services (`gyre run`: embedded NATS
and Postgres, every service its own process) on `num_devices / devices_per_unit` logical CPU
devices, each paced as one scheduling unit of the workload (`devices.pacing`, gyre/pacing.py),
with the `workload` environment drawing every execution's turns, tokens and tool latencies from the
file the simulator reads. Async runs at the split the simulator's sweep picks for the workload;
Elastic gets no split: it measures its home during the run (services/scheduler/split_meter.py). Then it prints, per policy: the
measured wall seconds per trainer step over the simulator's window (after `warmup_steps`), the
simulator's prediction (modelled seconds / time_scale) and the relative error, reassignments, live
migrations, executions interrupted, completed TRAIN handoffs, device-seconds per role (by lease and
by work) and the idle fraction as the simulator defines it (busy-based; app/analytics/device_time.py).
The run directories stay under --out, so `gyre compare` shows the same table for them.

The live system and the simulator are configured to mean the same thing: engine max batch =
the simulator's `engine_capacity`, rollout admission = `tasks_per_step` groups per weight version
within the staleness bound (0 for colocate), the plan loop period and the role-change time the
elastic policy weighs are the simulator's (1 modelled second, `elastic_role_change_s`) divided by
time_scale. The trajectory service forms batches by tokens, not by groups; the workload environment
gives every execution the same real tokens, so a budget of `tasks_per_step` groups' tokens makes a
trainer step train `tasks_per_step` groups, as a simulated step does (the first groups scored, where
the simulator trains step k's own groups).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml

from gyre.errors import ConfigError

POLICIES = ("colocate", "async", "elastic")
DEFAULT_WORKLOAD = Path("examples/workloads/paced_longtail.yaml")
MAX_TOKENS = (
    1  # real tokens per call (the action is the first token): the modelled ones come from the workload file
)


def live_tokens_per_group(w: Any) -> int:
    """Real tree tokens of one group under the workload environment: every execution has the same
    tokens; the members share the first two (BOS, the opening's role token)."""
    from services.rollout.environments.workload_plans import live_tokens_per_execution

    return w.group_size * live_tokens_per_execution(w, MAX_TOKENS) - 2 * (w.group_size - 1)


def run_config(
    w: Any,
    workload_file: Path,
    policy: str,
    *,
    time_scale: float,
    async_units: int,
    out: Path,
    timeout_s: float,
) -> dict[str, Any]:
    """The run YAML of one policy (every key a documented config field)."""
    from gyre.workload import sample_executions

    plans = [e for step in sample_executions(w) for e in step]
    slots = w.cost_model().engine_capacity(sum(e.final_context for e in plans) / len(plans))
    bound = 0 if policy == "colocate" else w.staleness_bound
    # A batch (one trainer step) is `tasks_per_step` groups, as a simulated step: the budget holds 4.5
    # groups' worth and a batch is built at 3.9 (so at the 4th group scored, never at the 3rd).
    group_tokens = live_tokens_per_group(w)
    batch_tokens = math.ceil((w.tasks_per_step + 0.5) * group_tokens)
    fill = (w.tasks_per_step - 0.1) * group_tokens / batch_tokens
    scheduler: dict[str, Any] = {
        "policy": policy,
        "staleness_bound": bound,
        "plan_interval_s": 1.0 / time_scale,
        "heartbeat_interval_s": 1.0,
        "role_change_s": w.costs.elastic_role_change_s / time_scale,
        "default_engine_capacity": slots,
        "drain_timeout_s": 60.0,
        "sim_workload": str(workload_file.resolve()),
    }
    if policy == "async":  # the sweep's best split; Elastic measures its own home (split_meter.py)
        scheduler["async_rollout_devices"] = async_units
    return {
        "run_id": f"bench-elastic-{policy}",
        "run_dir": str((out / policy).resolve()),
        "seed": w.seed,
        "log_level": "WARNING",
        "devices": {
            "pacing": {
                "enabled": True,
                "time_scale": time_scale,
                "workload_file": str(workload_file.resolve()),
                "switch_costs": "whole_pool" if policy == "colocate" else "per_device",
            }
        },
        "job": {
            "num_steps": w.num_steps,
            "timeout_s": timeout_s,
            "group_size": w.group_size,
            "live_groups": 0,
            "drain_s": 1.0,
            "ingest_wait_s": 30.0,
        },
        "scheduler": scheduler,
        "trajectory": {
            "group_size": w.group_size,
            "max_batch_tokens": batch_tokens,
            "min_batch_fill": round(fill, 6),
            "batch_max_wait_s": 3600.0,
            "ready_poll_s": 0.1,
            "max_staleness": w.staleness_bound + 2,
            "train_unfinished_after_s": (
                None
                if w.service.train_unfinished_after_s is None
                else w.service.train_unfinished_after_s / time_scale
            ),
        },
        "rollout": {
            "num_devices": w.num_units,
            "engine": "torch",
            "engine_max_batch": slots,
            "environment": "workload",
            "num_tasks": w.tasks_per_step,
            "group_size": w.group_size,
            "continuous": True,
            "groups_per_version": w.tasks_per_step,
            "max_staleness": bound,
            "max_live_executions": 4 * w.executions_per_step,
            "context": "none",
            "max_tokens": MAX_TOKENS,
            "max_calls": 10_000,
            "max_context_tokens": 4096,
            "openai": {"port": None},
            "report_load_interval_s": 0.5,
        },
        "trainer": {
            "batch_max_tokens": batch_tokens,
            "micro_batch_tokens": 2 * group_tokens,
            "max_staleness": w.staleness_bound + 2,
            "pull_wait_s": 0.5,  # short: a device released mid-pull leaves at the next boundary
            "report_load_interval_s": 0.5,
            "checkpoint_every": 1000,
            # The simulator's trainer semantics, so that the prediction models this trainer: a
            # streaming trainer trains a step's groups as they are scored.
            "streaming": w.service.trainer_streaming,
            # A step ends when its parts fill min_batch_fill (the batch rule above), as the
            # simulator's step k trains batch k's groups; this wait is only the fallback.
            "stream_wait_s": 30.0,
        },
    }


def predict_policy(w: Any, policy: str, async_units: int) -> dict[str, Any]:
    """The simulator's numbers for one policy on the workload (modelled seconds)."""
    from services.scheduler.sim import predict

    split = async_units * w.devices_per_unit if policy == "async" else None  # elastic: no sweep input
    return predict(w, policy, num_rollout_devices=split)


def row(measured: dict[str, Any], predicted: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """One policy's line: measured next to predicted, relative error = predicted / measured - 1."""
    pred_s = predicted["time_per_step_s"] / time_scale
    meas_s = measured.get("s_per_step")
    out = {
        "s_per_step": meas_s,
        "predicted_s_per_step": pred_s,
        "relative_error": (pred_s / meas_s - 1) if meas_s else None,
        "reassignments": measured["reassignments"],
        "reassignments_in_window": measured["reassignments_in_window"],
        "live_migrations": measured["live_migrations"],
        "executions_interrupted": measured["executions_interrupted"],
        "train_handoffs": measured["train_handoffs"],
        "parts_per_step": measured.get("parts_per_step"),
        "device_s_by_lease": measured["lease_device_s"],
        "device_s_busy": measured["busy_device_s"],
        "idle_fraction": measured["idle_fraction_busy"],
        "predicted_idle_fraction": predicted.get("device_idle_fraction"),
        "idle_fraction_by_lease": measured["idle_fraction_lease"],
        "predicted_migrations": predicted.get("num_migrations"),
        "predicted_role_changes": predicted.get("num_role_changes"),
        "num_steps": measured["num_steps"],
        "completed": measured["completed"],
        "run_dir": measured["run_dir"],
    }
    return out


def verdicts(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, each True/False (None when a policy did not run or measure)."""

    def s(p: str) -> float | None:
        return (rows.get(p) or {}).get("s_per_step")

    out: dict[str, Any] = {
        "no_execution_interrupted": all(r["executions_interrupted"] == 0 for r in rows.values()),
        "train_handoff_under_async_and_elastic": all(
            (rows.get(p) or {}).get("train_handoffs", 0) >= 1 for p in ("async", "elastic")
        ),
        "predictions_within_20pct": all(
            r["relative_error"] is not None and abs(r["relative_error"]) <= 0.2 for r in rows.values()
        ),
    }
    c, a, e = s("colocate"), s("async"), s("elastic")
    out["elastic_speedup_vs_colocate"] = c / e if c and e else None
    out["elastic_speedup_vs_async"] = a / e if a and e else None
    out["elastic_1.3x_colocate"] = (
        None if out["elastic_speedup_vs_colocate"] is None else out["elastic_speedup_vs_colocate"] >= 1.3
    )
    out["elastic_no_slower_than_async"] = (
        None if out["elastic_speedup_vs_async"] is None else out["elastic_speedup_vs_async"] >= 1.0
    )
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gyre bench elastic", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--workload-file", type=Path, default=DEFAULT_WORKLOAD, help="workload YAML (docs/simulator.md)"
    )
    p.add_argument(
        "--time-scale", type=float, default=20.0, help="modelled seconds per wall second (default 20)"
    )
    p.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated subset (default: all three)"
    )
    p.add_argument(
        "--out", type=Path, default=Path("runs/bench-elastic"), help="parent of the run directories"
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="wall-clock limit of each policy's job (s)")
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from pydantic import ValidationError

    from app.analytics.device_time import measure_run
    from app.job.run import run_job
    from gyre.workload import load_workload_file
    from services.scheduler.sim.compare import sweep_async

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        print(
            f"gyre bench elastic: unknown policies {bad}; choose from {', '.join(POLICIES)}", file=sys.stderr
        )
        return 2
    if not args.time_scale > 0:
        print("gyre bench elastic: --time-scale must be > 0", file=sys.stderr)
        return 2
    try:
        w = load_workload_file(args.workload_file)
    except (ValueError, ValidationError, OSError) as exc:
        print(f"gyre bench elastic: {exc}", file=sys.stderr)
        return 2
    _, async_units, _ = sweep_async(w)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    log = sys.stderr if args.json else sys.stdout
    for policy in policies:
        raw = run_config(
            w,
            args.workload_file,
            policy,
            time_scale=args.time_scale,
            async_units=async_units,
            out=args.out,
            timeout_s=args.timeout_s,
        )
        path = args.out / f"{policy}.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        print(f"== {policy}: gyre run {path}", file=log, flush=True)
        try:
            with contextlib.redirect_stdout(log):
                status = run_job(path)
        except ConfigError as exc:
            print(f"gyre bench elastic: {exc}", file=sys.stderr)
            return 2
        try:
            measured = measure_run(args.out / policy)
        except (ValueError, OSError) as exc:
            print(f"gyre bench elastic: {policy}: nothing measured ({exc})", file=sys.stderr)
            continue
        measured["exit_status"] = status
        rows[policy] = row(measured, predict_policy(w, policy, async_units), args.time_scale)
    result = {
        "command": "gyre bench elastic " + " ".join(argv if argv is not None else sys.argv[3:]),
        "workload": w.name,
        "workload_file": str(args.workload_file),
        "time_scale": args.time_scale,
        "seed": w.seed,
        "num_devices": w.num_units,
        "async_rollout_devices": async_units,
        "policies": rows,
        "targets": verdicts(rows),
    }
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print(format_table(result))
    return 0 if len(rows) == len(policies) else 1


def _n(x: Any, fmt: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def format_table(result: dict[str, Any]) -> str:
    """The bench result as a short text table (one line per policy)."""
    lines = [
        f"workload {result['workload']} at time_scale {result['time_scale']} ({result['num_devices']} devices, "
        f"async split {result['async_rollout_devices']} rollout)",
        f"{'policy':<9} {'s/step':>7} {'sim':>7} {'err':>7} {'reassign':>8} {'in run':>6} {'migr':>5} {'interr':>6} "
        f"{'train handoffs':>14} {'parts/step':>10} {'idle(busy)':>10} {'sim idle':>8} {'idle(lease)':>11}",
    ]
    for p, r in result["policies"].items():
        lines.append(
            f"{p:<9} {_n(r['s_per_step']):>7} {_n(r['predicted_s_per_step']):>7} {_n(r['relative_error'], '+.1%'):>7} "
            f"{r['reassignments']:>8} {r.get('reassignments_in_window', 0):>6} {r['live_migrations']:>5} {r['executions_interrupted']:>6} "
            f"{r['train_handoffs']:>14} {_n(r.get('parts_per_step'), '.2f'):>10} "
            f"{_n(r['idle_fraction'], '.3f'):>10} "
            f"{_n(r['predicted_idle_fraction'], '.3f'):>8} {_n(r['idle_fraction_by_lease'], '.3f'):>11}"
        )
    lines.append("targets: " + json.dumps(result["targets"], default=str))
    return "\n".join(lines)
