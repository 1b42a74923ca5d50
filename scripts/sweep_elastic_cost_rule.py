"""Sweep Elastic's cost rule (`min_step_over_switch`) over the shipped workloads in the simulator.

    .venv/bin/python scripts/sweep_elastic_cost_rule.py [--factors 20,5,3,2.5,2,1.5,1] [--seeds 5]
        [--spread-idle] [--pack-tail] [--workloads xlong,examples/workloads/light_tail.yaml,...]
        [--cache DIR] > rows.jsonl

The factor is the number of role changes a trainer step (or the training left in the step in
progress) must outlast before Elastic makes an optional move (lending tail engines to the trainer,
with `--spread-idle` spreading rollout over an idle trainer's devices, and with `--pack-tail`
consolidating the tail's executions onto fewer engines to lend more; the shipped policy does
neither). Per workload and seed this prints one JSON line: the best
swept fixed split (as `gyre sim` finds it) and, per factor, Elastic's speedup over it per windowed
step (`kF`), by makespan (`kF_mk`) and over Async at half the pool (`kF_half`). The sweep of fixed
splits does not depend on the factor, so `--cache` keeps it per workload and seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.workload import BUILTIN_WORKLOADS, Workload, builtin, load_workload_file  # noqa: E402
from services.scheduler.policies import AsyncPolicy, ElasticPolicy  # noqa: E402
from services.scheduler.sim.compare import simulate, sweep_async_runs, with_seed  # noqa: E402


def workloads(names: str | None) -> list[Workload]:
    if names:
        return [load_workload_file(n) if n.endswith(".yaml") else builtin(n) for n in names.split(",")]
    files = sorted((ROOT / "examples" / "workloads").glob("*.yaml"))
    return list(BUILTIN_WORKLOADS.values()) + [load_workload_file(f) for f in files]


def baseline(w: Workload, cache: Path | None) -> dict[str, float]:
    path = cache / f"{w.name}-{w.seed}.json" if cache else None
    if path and path.exists():
        return dict(json.loads(path.read_text()))
    runs = sweep_async_runs(w)
    best = min(runs, key=lambda u: (runs[u].time_per_step_s, u))
    h = max(1, w.num_units // 2)
    half = runs[h] if h in runs else simulate(w, AsyncPolicy(h, staleness_bound=w.staleness_bound))
    out = {
        "best_units": best,
        "time_per_step_s": runs[best].time_per_step_s,
        "makespan_s": runs[best].step_done_s[-1],
        "half_time_per_step_s": half.time_per_step_s,
    }
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--factors", default="20,5,3,2.5,2,1.5,1", help="comma-separated min_step_over_switch values"
    )
    p.add_argument(
        "--spread-idle", action="store_true", help="Elastic spreads rollout over an idle trainer's devices"
    )
    p.add_argument(
        "--pack-tail", action="store_true", help="Elastic packs the tail's executions to lend more"
    )
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--workloads", help="comma-separated built-in names or YAML files (default: all shipped)")
    p.add_argument("--cache", type=Path, help="directory keeping each workload-seed's fixed-split sweep")
    args = p.parse_args(argv)
    factors = [float(x) for x in args.factors.split(",")]
    for w0 in workloads(args.workloads):
        for i in range(args.seeds):
            w = with_seed(w0, w0.seed + i)
            base = baseline(w, args.cache)
            row: dict[str, object] = {"workload": w.name, "seed": w.seed, "best_units": base["best_units"]}
            for f in factors:
                policy = ElasticPolicy(
                    staleness_bound=w.staleness_bound,
                    role_change_s=w.costs.elastic_role_change_s,
                    min_step_over_switch=f,
                    spread_idle=args.spread_idle,
                    pack_tail=args.pack_tail,
                )
                r = simulate(w, policy)
                row[f"k{f:g}"] = round(base["time_per_step_s"] / r.time_per_step_s, 4)
                row[f"k{f:g}_mk"] = round(base["makespan_s"] / r.step_done_s[-1], 4)
                row[f"k{f:g}_half"] = round(base["half_time_per_step_s"] / r.time_per_step_s, 4)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
