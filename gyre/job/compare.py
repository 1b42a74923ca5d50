"""`gyre compare RUN_DIR...`: runs side by side, with the simulator's prediction for the same setup.

For each run directory it reads `summary.json` (rebuilding the report from `events.jsonl` when the
summary is missing) and prints one column per run: policy, trainer steps, time per step, device
idle fraction, reward_first20 / reward_last20 and the learning verdict. Below, the cluster
simulator (`services.scheduler.sim`, imported only here and only when present) predicts time per
step and device idle fraction for the same configuration (the run's `config.yaml`) under each
run's policy, next to the measured values, with the predicted/measured ratio.
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

from gyre.job.report import SUMMARY_NAME, build_report


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


def predict(run_dir: Path, summary: dict[str, Any]) -> tuple[dict[str, float] | None, str]:
    """The simulator's (time_per_step_s, device_idle_fraction) for this run's config and policy.

    Returns (None, why) when the simulator or the run's config is not available.
    """
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        return None, f"no {config_path.name} in the run directory"
    try:
        from services.scheduler import sim
    except ImportError as exc:
        return None, f"simulator not installed ({exc})"
    fn = getattr(sim, "predict", None)
    if fn is None:
        return None, "services.scheduler.sim has no predict()"
    try:
        result = fn(config_path, policy=summary.get("policy") or None, measured=summary)
    except Exception as exc:  # a prediction failure must not hide the measured table
        return None, f"simulator failed: {exc!r}"
    if hasattr(result, "_asdict"):
        result = result._asdict()
    elif not isinstance(result, dict):
        result = {
            k: getattr(result, k) for k in ("time_per_step_s", "device_idle_fraction") if hasattr(result, k)
        }
    return {k: float(v) for k, v in result.items() if isinstance(v, int | float)}, ""


def compare_table(run_dirs: list[Path]) -> Table:
    """The side-by-side table (rich) of the given runs."""
    summaries = [load_summary(d) for d in run_dirs]
    table = Table(title="Gyre runs", show_lines=False)
    table.add_column("", style="bold")
    for d, s in zip(run_dirs, summaries, strict=True):
        table.add_column(f"{d.name}\n({s.get('policy') or '?'})", justify="right")

    def row(name: str, values: list[str]) -> None:
        table.add_row(name, *values)

    row("trainer steps", [str(s.get("num_steps")) for s in summaries])
    row("devices", [str(s.get("num_devices")) for s in summaries])
    row("time per step (s)", [_f(s.get("time_per_step_s")) for s in summaries])
    row("device idle fraction", [_f(s.get("device_idle_fraction"), ".3f") for s in summaries])
    row("reassignments", [str(s.get("num_reassignments")) for s in summaries])
    row("tokens/s", [_f(s.get("tokens_per_s"), ".0f") for s in summaries])
    row("tree-token ratio", [_f(s.get("tree_token_ratio")) for s in summaries])
    row("max staleness", [str(s.get("max_batch_staleness")) for s in summaries])
    row("reward_first20", [_iv(s.get("reward_first20")) for s in summaries])
    row("reward_last20", [_iv(s.get("reward_last20")) for s in summaries])
    row("learned", ["yes" if s.get("learned") else "no" for s in summaries])
    preds = [predict(d, s) for d, s in zip(run_dirs, summaries, strict=True)]
    for key, label, fmt in (
        ("time_per_step_s", "sim: time per step (s)", ".2f"),
        ("device_idle_fraction", "sim: device idle fraction", ".3f"),
    ):
        cells = []
        for (pred, _why), s in zip(preds, summaries, strict=True):
            if pred is None or key not in pred:
                cells.append("n/a")
                continue
            measured = s.get(key)
            ratio = f" ({pred[key] / measured:.2f}x)" if measured else ""
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
            out[str(d)] = {"measured": s, "predicted": pred, "prediction_note": why}
        print(json.dumps(out, indent=2, default=str))
        return 0
    Console().print(compare_table(args.run_dirs))
    return 0
