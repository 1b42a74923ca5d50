"""`gyre compare RUN_DIR...`: runs side by side, with the simulator's prediction for the same setup.

For each run directory it reads `summary.json` (rebuilding the report from `events.jsonl` when the
summary is missing) and the device measurements of app/analytics/device_time.py, and prints one
column per run: policy, trainer steps, time per step (whole run, and over the simulator's window
after its warm-up steps), reassignments, live migrations, executions interrupted, TRAIN handoffs,
device-seconds per role by lease and by work, the idle fraction as the simulator defines it
(busy-based: paced runs log busy time) and, labelled as such, the share of device-time without a
lease (what the report calls idle by lease: a different quantity, never compared with the
simulator's), reward_first20 / reward_last20 and the learning verdict. Below, the cluster simulator
(`services.scheduler.sim`, imported only here and only when present) predicts time per step and
busy-based idle fraction for the same configuration (the run's `config.yaml`) under each run's
policy, next to the measured values, with the predicted/measured ratio. A paced run
(`devices.pacing`) is predicted from its workload file, in modelled seconds / time_scale, at the
run's own async split.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from app.job.report import SUMMARY_NAME, build_report


def load_summary(run_dir: Path) -> dict[str, Any]:
    """summary.json of a run directory; built from events.jsonl when absent."""
    path = run_dir / SUMMARY_NAME
    if path.is_file():
        return dict(json.loads(path.read_text()))
    return build_report(run_dir).summary


def _f(x: Any, fmt: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return format(x, fmt)


def _iv(iv: dict[str, Any] | None) -> str:
    if not iv:
        return "n/a"
    return f"{_f(iv.get('mean'), '.3f')} [{_f(iv.get('low'), '.3f')}, {_f(iv.get('high'), '.3f')}]"


def workload_for_run(run_dir: Path, summary: dict[str, Any]) -> Any:
    """A simulator Workload describing this run, calibrated on the run's own measurements.

    Shape from the run: devices (one logical device per scheduling unit), tasks and group size per
    step, the execution lengths (final context: median and log-sigma; tokens per turn; generated
    share), the model's size (trainer.model, else the default tiny model, fp32 weights). Hardware
    constants are *fitted to the run*, so the prediction tests the scheduling model, not a CPU model:
    the "HBM bandwidth" makes one decode step of one sequence take as long as the run's measured
    per-rollout-device token rate implies (CPU decode batches poorly: one sequence per step is the
    conservative reading), the peak FLOP/s makes a training step take the measured train
    time per step (its `step_s` metric; else train device-seconds per step), role switches cost the measured mean switching time. No environment
    latency (the long-horizon environment answers in microseconds).
    """
    import yaml

    from gyre.model.config import ModelConfig
    from services.scheduler.sim import Workload

    raw = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    model = ModelConfig.model_validate(((raw.get("trainer") or {}).get("model")) or {})
    job = raw.get("job") or {}
    h, layers = model.hidden_size, model.num_layers
    params = layers * (4 * h * h + 3 * h * model.ffn_hidden_size) + 2 * model.vocab_size * h
    weight_bytes = 4.0 * params
    steps = max(1, int(summary.get("num_steps") or 1))
    num_devices = max(2, int(summary.get("num_devices") or 4))
    group_size = int(job.get("group_size", 4))
    tasks_per_step = max(1, round((summary.get("num_groups_scored") or group_size) / steps))
    ctx = summary.get("execution_context_tokens") or {}
    calls = summary.get("execution_num_calls") or {}
    gen = summary.get("execution_generated_tokens") or {}
    median_ctx = float(ctx.get("median") or 64.0)
    tokens_per_turn = max(
        1.0, float(ctx.get("mean") or median_ctx) / max(1.0, float(calls.get("mean") or 1.0))
    )
    generated_fraction = min(
        1.0, max(0.01, float(gen.get("mean") or 1.0) / float(ctx.get("mean") or median_ctx))
    )
    rollout_devices = max(
        1e-9, float(summary.get("rollout_device_s") or 0.0) / max(1e-9, summary.get("duration_s") or 1.0)
    )
    tokens_per_s_per_device = max(1.0, float(summary.get("tokens_per_s") or 1.0) / max(rollout_devices, 1.0))
    efficiency = 0.8
    bandwidth = weight_bytes * tokens_per_s_per_device / efficiency
    # the trainer's own step time when it reports one (it may train without holding a device)
    train_s_per_step = max(
        0.05, float(summary.get("trainer_step_s") or (summary.get("train_device_s") or 1.0) / steps)
    )
    train_tokens_per_step = max(
        1.0, float(summary.get("trainer_tokens_per_step") or (summary.get("batch_tokens") or 1.0) / steps)
    )
    mfu = 0.4
    peak_flops = 6.0 * params * train_tokens_per_step / (mfu * train_s_per_step)
    switch_s = float(summary.get("mean_switch_s") or 0.5)
    return Workload.model_validate(
        {
            "name": f"run:{run_dir.name}",
            "description": "calibrated on a measured gyre run",
            "num_devices": num_devices,
            "devices_per_unit": 1,
            "tasks_per_step": tasks_per_step,
            "group_size": group_size,
            "num_steps": max(4, steps),
            "warmup_steps": 1,
            "staleness_bound": int((raw.get("trajectory") or {}).get("max_staleness", 1)),
            "seed": int(raw.get("seed", 0)),
            "domains": [
                {
                    "name": "longhorizon",
                    "context_median_tokens": median_ctx,
                    "context_sigma": float(ctx.get("log_sigma") or 0.5),
                    "context_cap_tokens": float(model.max_position_embeddings),
                    "generated_fraction": generated_fraction,
                    "tokens_per_turn": tokens_per_turn,
                }
            ],
            "model": {
                "params": float(params),
                "weight_bytes": weight_bytes,
                "kv_bytes_per_token": 2.0 * layers * h * 4,
                "num_layers": layers,
                "attention_dim": h,
            },
            "hardware": {
                "hbm_bytes": 8.0 * 2**30,
                "hbm_bandwidth_bytes_s": bandwidth,
                "bandwidth_efficiency": efficiency,
                "peak_flops": peak_flops,
                "migration_bandwidth_bytes_s": 1e9,
            },
            "costs": {
                "train_mfu": mfu,
                "switch_rollout_to_train_s": switch_s,
                "switch_train_to_rollout_s": switch_s,
                "elastic_role_change_s": switch_s,
                "weight_sync_s": 0.1,
                "migration_overhead_s": 0.01,
            },
        }
    )


def predict(run_dir: Path, summary: dict[str, Any]) -> tuple[dict[str, float] | None, str]:
    """The simulator's time_per_step_s and idle_fraction_busy (1 - its busy-based device utilization;
    the run summary's `device_idle_fraction` is the no-lease share, a different quantity, so the
    prediction never carries that name) for this run's config and policy.

    Returns (None, why) when the simulator or the run's config is not available.
    """
    if not (run_dir / "config.yaml").is_file():
        return None, "no config.yaml in the run directory"
    policy = summary.get("policy") or ""
    if policy not in ("colocate", "async", "elastic"):
        return None, f"unknown policy {policy!r} in the run's events"
    try:
        from services.scheduler import sim
    except ImportError as exc:
        return None, f"simulator not installed ({exc})"
    try:
        import yaml

        raw = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        named = (raw.get("scheduler") or {}).get("sim_workload")
        pacing = ((raw.get("devices") or {}).get("pacing")) or {}
        # a workload file named by the config wins; else one calibrated on the run itself
        workload: Any = run_dir / "config.yaml" if named else workload_for_run(run_dir, summary)
        rollout_devices = None
        if policy in ("async", "elastic"):  # async's split; elastic's home (the operator's split)
            rollout_devices = (raw.get("scheduler") or {}).get("async_rollout_devices")
            if rollout_devices is None and policy == "async" and summary.get("duration_s"):
                rollout_devices = round(
                    float(summary.get("rollout_device_s") or 0.0) / float(summary["duration_s"])
                )
        if pacing.get("enabled") and pacing.get("workload_file"):
            from gyre.workload import load_workload_file

            workload = load_workload_file(pacing["workload_file"])
            if rollout_devices:  # one live device = one scheduling unit of the workload
                rollout_devices = int(rollout_devices) * workload.devices_per_unit
        result = sim.predict(workload, policy, num_rollout_devices=rollout_devices or None, measured=summary)
        if pacing.get("enabled"):  # modelled seconds -> wall seconds of the paced run
            for key in ("time_per_step_s", "makespan_s"):
                if key in result:
                    result[key] = float(result[key]) / float(pacing.get("time_scale") or 1.0)
    except Exception as exc:  # a prediction failure must not hide the measured table
        return None, f"simulator failed: {exc!r}"
    out = {k: float(v) for k, v in result.items() if isinstance(v, int | float)}
    out.pop("device_idle_fraction", None)
    if "device_utilization" in out:
        out["idle_fraction_busy"] = 1.0 - out["device_utilization"]
    return out, ""


def _measure(run_dir: Path) -> dict[str, Any]:
    """The device measurements of a run (app/analytics/device_time.py); {} when it has no events."""
    from app.analytics.device_time import measure_run

    try:
        return measure_run(run_dir)
    except (ValueError, OSError):
        return {}


def _pair(m: dict[str, Any], role: str) -> str:
    lease = (m.get("lease_device_s") or {}).get(role)
    busy = m.get("busy_device_s")
    return f"{_f(lease, '.0f')} / {_f(busy.get(role, 0.0), '.0f') if busy is not None else 'n/a'}"


def compare_table(run_dirs: list[Path]) -> Table:
    """The side-by-side table (rich) of the given runs."""
    summaries = [load_summary(d) for d in run_dirs]
    table = Table(title="Gyre runs", show_lines=False)
    table.add_column("", style="bold")
    for d, s in zip(run_dirs, summaries, strict=True):
        table.add_column(f"{d.name}\n({s.get('policy') or '?'})", justify="right")

    def row(name: str, values: list[str]) -> None:
        table.add_row(name, *values)

    measured = [_measure(d) for d in run_dirs]
    row("trainer steps", [str(s.get("num_steps")) for s in summaries])
    row("devices", [str(s.get("num_devices")) for s in summaries])
    row("time per step (s), whole run", [_f(s.get("time_per_step_s")) for s in summaries])
    row("s/step after warm-up (sim window)", [_f(m.get("s_per_step")) for m in measured])
    row("idle fraction, busy-based (as sim)", [_f(m.get("idle_fraction_busy"), ".3f") for m in measured])
    row("no-lease share (not sim's idle)", [_f(m.get("idle_fraction_lease"), ".3f") for m in measured])
    for role in ("rollout", "train"):
        row(f"device-s {role}: lease / busy", [_pair(m, role) for m in measured])
    row("reassignments", [str(s.get("num_reassignments")) for s in summaries])
    row("live migrations", [str(m.get("live_migrations", "n/a")) for m in measured])
    row("executions interrupted", [str(m.get("executions_interrupted", "n/a")) for m in measured])
    row("TRAIN handoffs", [str(m.get("train_handoffs", "n/a")) for m in measured])
    row("tokens/s", [_f(s.get("tokens_per_s"), ".0f") for s in summaries])
    row("tree-token ratio", [_f(s.get("tree_token_ratio")) for s in summaries])
    row("max staleness", [str(s.get("max_batch_staleness")) for s in summaries])
    row("reward_first20", [_iv(s.get("reward_first20")) for s in summaries])
    row("reward_last20", [_iv(s.get("reward_last20")) for s in summaries])
    row("learned", ["yes" if s.get("learned") else "no" for s in summaries])
    preds = [predict(d, s) for d, s in zip(run_dirs, summaries, strict=True)]
    for key, label, fmt in (
        ("time_per_step_s", "sim: s/step (vs sim window)", ".2f"),
        ("idle_fraction_busy", "sim: idle fraction (vs busy-based)", ".3f"),
    ):
        cells = []
        for (pred, _why), m, s in zip(preds, measured, summaries, strict=True):
            if pred is None or key not in pred:
                cells.append("n/a")
                continue
            if key == "time_per_step_s":
                against = m.get("s_per_step") or s.get(key)
            else:
                against = m.get("idle_fraction_busy")  # never the lease-based share
            ratio = f" ({pred[key] / against:.2f}x)" if against else ""
            cells.append(_f(pred[key], fmt) + ratio)
        row(label, cells)
    reasons = sorted({why for pred, why in preds if pred is None and why})
    if reasons:
        table.caption = "simulator: " + "; ".join(reasons)
    else:
        table.caption = "sim rows: simulator prediction for the same config and policy (predicted / measured)"
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre compare", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories written by `gyre run`")
    parser.add_argument("--json", action="store_true", help="print the summaries as one JSON object instead")
    args = parser.parse_args(argv)
    missing = [
        d for d in args.run_dirs if not (d / SUMMARY_NAME).is_file() and not (d / "events.jsonl").is_file()
    ]
    if missing:
        print(
            f"error: not a run directory (no summary.json or events.jsonl): {', '.join(map(str, missing))}",
            file=sys.stderr,
        )
        return 2
    if args.json:
        out = {}
        for d in args.run_dirs:
            s = load_summary(d)
            pred, why = predict(d, s)
            out[str(d)] = {"measured": s, "devices": _measure(d), "predicted": pred, "prediction_note": why}
        print(json.dumps(out, indent=2, default=str))
        return 0
    Console().print(compare_table(args.run_dirs))
    return 0
