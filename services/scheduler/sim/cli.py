"""`gyre sim`: run Colocate, the best Async split and Elastic on a workload and report.

gyre sim --workload xlong --json
gyre sim --workload-file examples/workloads/small.yaml --plot sim.png
"""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gyre sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--workload", default="xlong", help="built-in workload: xlong, reasoning, mixed (default xlong)"
    )
    src.add_argument("--workload-file", help="YAML workload in the schema of docs/simulator.md")
    p.add_argument("--staleness-bound", type=int, help="override the workload's bound (async and elastic)")
    p.add_argument("--json", action="store_true", help="print one JSON object (default: a short table)")
    p.add_argument("--plot", help="write the role timelines and utilization to this PNG file")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from pydantic import ValidationError

    from services.scheduler.sim import builtin, compare, load_workload_file

    try:
        w = load_workload_file(args.workload_file) if args.workload_file else builtin(args.workload)
        if args.staleness_bound is not None:
            w = w.model_validate({**w.model_dump(), "staleness_bound": args.staleness_bound})
    except (ValueError, ValidationError, OSError) as exc:
        print(f"gyre sim: {exc}", file=sys.stderr)
        return 2
    result = compare(w)
    out = result.to_json()
    if args.plot:
        from services.scheduler.sim.plot import plot_comparison

        plot_comparison(result, args.plot)
        out["plot"] = args.plot
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"workload {w.name}: {w.description}")
    for name in ("colocate", "async", "elastic"):
        r = out[name]
        print(
            f"  {name:<9} {r['time_per_step_s']:>10.1f} s/step  utilization {r['device_utilization']:.1%}  "
            f"max staleness {r['max_staleness']}"
        )
    split = out["best_async_split"]
    print(f"  best async split: {split['rollout_devices']} rollout / {split['train_devices']} train devices")
    print(
        f"  elastic speedup: {out['speedup_vs_colocate']}x vs colocate, {out['speedup_vs_async']}x vs async"
    )
    return 0
