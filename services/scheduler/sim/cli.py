"""`gyre sim`: run Colocate, the best Async split, Elastic and the paper's baselines on a workload.

gyre sim --workload xlong --json --seeds 5
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
    p.add_argument(
        "--train-unfinished-after-s",
        type=float,
        help="partial progress: score unfinished executions this long after their group's first ended "
        "(as trajectory.train_unfinished_after_s; every row but the paper baselines)",
    )
    p.add_argument(
        "--seeds", type=int, default=1, help="seeds to run (seed, seed+1, ...); ratios get a 95%% interval"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (default: a short table)")
    p.add_argument(
        "--plot", help="write the role timelines and utilization of the first seed to this PNG file"
    )
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from pydantic import ValidationError

    from services.scheduler.sim import builtin, load_workload_file
    from services.scheduler.sim.compare import compare_seeds

    try:
        w = load_workload_file(args.workload_file) if args.workload_file else builtin(args.workload)
        if args.staleness_bound is not None:
            w = w.model_validate({**w.model_dump(), "staleness_bound": args.staleness_bound})
        if args.train_unfinished_after_s is not None:
            sem = w.service.model_copy(update={"train_unfinished_after_s": args.train_unfinished_after_s})
            w = w.model_validate({**w.model_dump(), "service": sem.model_dump()})
        if args.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    except (ValueError, ValidationError, OSError) as exc:
        print(f"gyre sim: {exc}", file=sys.stderr)
        return 2
    result = compare_seeds(w, args.seeds)
    out = result.to_json()
    if args.plot:
        from services.scheduler.sim.plot import plot_comparison

        plot_comparison(result.per_seed[0], args.plot)
        out["plot"] = args.plot
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"workload {w.name}: {w.description}  (seeds {out['seeds']})")
    for name in (
        "colocate",
        "async",
        "async_half",
        "async_phase_oracle",
        "elastic",
        "paper_colocate",
        "paper_async",
    ):
        r = out[name]
        t = r["time_per_step_s"]
        print(
            f"  {name:<18} {t['mean']:>10.1f} s/step [{t['low']:.1f}, {t['high']:.1f}]  "
            f"generated tokens trained {r['generated_trained_share']:.1%}  utilization {r['device_utilization']:.1%}"
        )
    for k, v in out["speedup"].items():
        print(f"  elastic speedup {k:<18} {v['mean']:.3f}x  95% [{v['low']:.3f}, {v['high']:.3f}]")
    return 0
