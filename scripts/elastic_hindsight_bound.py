"""How much any configuration of Elastic's mechanisms gains on a workload, chosen with hindsight.

    .venv/bin/python scripts/elastic_hindsight_bound.py [--factors 2,20] [--seeds 5]
        [--workloads examples/workloads/drift_lengths.yaml,...] > rows.jsonl

The makespan ceiling (sim/bound.py) drops every queueing and contention cost, so a target inside it
may still be out of reach of the policy. This asks the policy itself: per workload and seed, Elastic
runs with every home split the fixed-split sweep tried held for good (`home_rollout_devices`, as an
operator would fix it) at each cost-rule factor in `--factors`, and with the per-phase best split of
the sweep handed to it at each drift phase (`phase_splits`, the input it must never have), beside
the shipped Elastic (measured home, default factor). Each prints its speedup over the best swept
fixed split per windowed step; `best` is the largest of them all, i.e. the most this policy family
reaches on that seed when the configuration is picked after the fact. Where `best` misses a target,
no tuning of these mechanisms meets it on this simulator; a different mechanism would be needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sweep_elastic_cost_rule import workloads  # noqa: E402

from gyre.workload import Workload  # noqa: E402
from services.scheduler.policies import ElasticPolicy, PoolSnapshot  # noqa: E402
from services.scheduler.sim.compare import (  # noqa: E402
    elastic_policy,
    oracle_phases,
    phase_splits,
    simulate,
    sweep_async_runs,
    with_seed,
)
from services.scheduler.split_meter import SplitMeter  # noqa: E402


class ScheduledMeter(SplitMeter):
    """A home handed by weight version: `splits[v]` rollout units while version v is the newest."""

    def __init__(self, splits: list[int]) -> None:
        super().__init__()
        self.splits = splits

    def observe(self, snapshot: PoolSnapshot, now_s: float) -> PoolSnapshot:
        self.home = self.splits[min(snapshot.latest_version, len(self.splits) - 1)]
        return dataclasses.replace(snapshot, measured_home_rollout=self.home)


def row_for(w: Workload, factors: list[float]) -> dict[str, object]:
    """One workload-seed: the shipped Elastic, every fixed home at every factor, the phase-handed
    homes, each as a speedup over the best swept fixed split per windowed step."""
    runs = sweep_async_runs(w)
    best_s = min(r.time_per_step_s for r in runs.values())
    row: dict[str, object] = {"workload": w.name, "seed": w.seed}
    row["shipped"] = round(best_s / simulate(w, elastic_policy(w)).time_per_step_s, 4)
    homes: dict[str, float] = {}
    for units in sorted(runs):
        for f in factors:
            policy = ElasticPolicy(
                staleness_bound=w.staleness_bound,
                role_change_s=w.costs.elastic_role_change_s,
                min_step_over_switch=f,
                home_rollout_devices=units,
            )
            homes[f"{units}@{f:g}"] = round(best_s / simulate(w, policy).time_per_step_s, 4)
    row["fixed_homes"] = homes
    handed = []
    for phases in oracle_phases(w):
        splits = phase_splits(w, runs, phases)
        r = simulate(w, elastic_policy(w), split_meter=ScheduledMeter(splits))
        handed.append({"splits": splits, "speedup": round(best_s / r.time_per_step_s, 4)})
    row["phase_handed"] = handed
    candidates = [float(row["shipped"]), *homes.values(), *(h["speedup"] for h in handed)]
    row["best"] = max(candidates)
    row["best_of"] = max(homes, key=lambda k: homes[k]) if max(homes.values()) == row["best"] else "other"
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--factors", default="2,20", help="comma-separated min_step_over_switch values")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument(
        "--workloads",
        default="examples/workloads/drift_lengths.yaml,examples/workloads/paced_drift.yaml",
        help="comma-separated built-in names or YAML files",
    )
    args = p.parse_args(argv)
    factors = [float(x) for x in args.factors.split(",")]
    for w0 in workloads(args.workloads):
        for i in range(args.seeds):
            print(json.dumps(row_for(with_seed(w0, w0.seed + i), factors)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
