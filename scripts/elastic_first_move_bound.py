"""How early Elastic must know its best split: the simulator's Elastic handed the swept best split
(the input it must never have) at weight version V, against the shipped meter that finds it online.

    .venv/bin/python scripts/elastic_first_move_bound.py [--versions 0,1,2,3] [--seeds 5]
        [--workloads reasoning,examples/workloads/light_tail.yaml,...] [--cache DIR] > rows.jsonl

A bound on any meter that decides from measured steps: until version V the shipped meter runs (it
has not moved yet for V up to bound + 2, the version its first decision reads), from V on the home
is the best swept fixed split and stays there. Per workload and seed this prints one JSON line with
Elastic's speedup over that best split per windowed step, for the shipped meter (`meter`) and
handed the split at each V (`vV`). Handed at 0 Elastic runs as Async at that split; where handing
it at the shipped meter's first decision already misses a target, no meter deciding from the steps
it measures can reach it (the run's remaining steps do not pay back the ones before). `--cache`
shares the fixed-split sweeps with scripts/sweep_elastic_cost_rule.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sweep_elastic_cost_rule import baseline, workloads  # noqa: E402

from gyre.workload import Workload  # noqa: E402
from services.scheduler.policies import PoolSnapshot  # noqa: E402
from services.scheduler.sim.compare import elastic_policy, simulate, with_seed  # noqa: E402
from services.scheduler.split_meter import SplitMeter  # noqa: E402


class HandedMeter(SplitMeter):
    """The shipped meter until weight version `at_version`, then `home` rollout units for good."""

    def __init__(self, home: int, at_version: int) -> None:
        super().__init__()
        self.handed_home = home
        self.at_version = at_version

    def observe(self, snapshot: PoolSnapshot, now_s: float) -> PoolSnapshot:
        if snapshot.latest_version < self.at_version:
            return super().observe(snapshot, now_s)
        self.home = self.handed_home
        return dataclasses.replace(snapshot, measured_home_rollout=self.handed_home)


def time_per_step(w: Workload, meter: SplitMeter | None) -> float:
    """Elastic's windowed seconds per step on `w`, with `meter` in place of the shipped one."""
    return simulate(w, elastic_policy(w), split_meter=meter).time_per_step_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--versions", default="0,1,2,3", help="comma-separated weight versions to hand the split at"
    )
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--workloads", help="comma-separated built-in names or YAML files (default: all shipped)")
    p.add_argument("--cache", type=Path, help="directory keeping each workload-seed's fixed-split sweep")
    args = p.parse_args(argv)
    versions = [int(x) for x in args.versions.split(",")]
    for w0 in workloads(args.workloads):
        for i in range(args.seeds):
            w = with_seed(w0, w0.seed + i)
            base = baseline(w, args.cache)
            best_s = base["time_per_step_s"]
            row: dict[str, object] = {"workload": w.name, "seed": w.seed, "best_units": base["best_units"]}
            row["meter"] = round(best_s / time_per_step(w, None), 4)
            for v in versions:
                meter = HandedMeter(int(base["best_units"]), v)
                row[f"v{v}"] = round(best_s / time_per_step(w, meter), 4)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
