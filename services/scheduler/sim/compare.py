"""Run the three policies on one workload at equal work and compare them.

Equal work: every policy trains exactly the same sampled executions, batch k at step k, each in
full (no policy trains on unfinished executions, so none needs the partial-scoring option).
Async and Elastic share the workload's staleness bound; Colocate is synchronous (0). The Async
baseline is the best fixed split found by `sweep_async` (every split on small pools, a grid refined
to single units on large ones; ties: fewer rollout units). Elastic gets no sweep of its own: its
home split is that same best split (`plan_elastic`). `critical_path_bound` is the time per step no
policy can beat (sim/bound.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from services.scheduler.policies import AsyncPolicy, ColocatePolicy, ElasticPolicy, Policy
from services.scheduler.sim.bound import critical_path_s_per_step
from services.scheduler.sim.cost import CostModel
from services.scheduler.sim.engine import SimResult, Simulation
from services.scheduler.sim.sample import ExecutionPlan, sample_executions
from services.scheduler.sim.workload import Workload, load_workload_file


def _prepared(w: Workload) -> tuple[list[list[ExecutionPlan]], CostModel]:
    return _prepared_json(w.model_dump_json())


@lru_cache(maxsize=8)
def _prepared_json(workload_json: str) -> tuple[list[list[ExecutionPlan]], CostModel]:
    w = Workload.model_validate_json(workload_json)
    execs = sample_executions(w)
    flat = [e.final_context for step in execs for e in step]
    return execs, CostModel(w, sum(flat) / len(flat))


def simulate(w: Workload, policy: Policy) -> SimResult:
    """One simulated run of `policy` on `w` (trajectories sampled once per workload and reused)."""
    execs, cost = _prepared(w)
    return Simulation(policy, cost, execs).run()


def sweep_async(w: Workload, coarse_points: int = 12) -> tuple[SimResult, int, dict[int, float]]:
    """Search the fixed split (rollout units 1..units-1): every split when there are at most
    `coarse_points`, else an evenly spaced grid refined around the best point down to single units.
    Returns the best run, its rollout-unit count and the time per step of every split tried."""
    times: dict[int, float] = {}
    runs: dict[int, SimResult] = {}

    def run(n: int) -> None:
        if n not in times and 1 <= n < w.num_units:
            runs[n] = simulate(w, AsyncPolicy(n, staleness_bound=w.staleness_bound))
            times[n] = runs[n].time_per_step_s

    span = w.num_units - 1
    stride = max(1, -(-span // coarse_points))
    for n in range(1, w.num_units, stride):
        run(n)
    while stride > 1:
        best = min(times, key=lambda n: (times[n], n))
        stride = max(1, stride // 2)
        run(best - stride)
        run(best + stride)
    best = min(times, key=lambda n: (times[n], n))
    return runs[best], best, dict(sorted(times.items()))


def _summary(r: SimResult) -> dict[str, Any]:
    return {
        "time_per_step_s": round(r.time_per_step_s, 1),
        "device_utilization": round(r.device_utilization, 4),
        "device_idle_fraction": round(1 - r.device_utilization, 4),
        "max_staleness": r.max_staleness,
        "num_migrations": r.num_migrations,
        "num_role_changes": r.num_role_changes,
        "num_parked": r.num_parked,
    }


@dataclass
class Comparison:
    workload: Workload
    results: dict[str, SimResult]
    best_async_units: int
    async_sweep: dict[int, float]
    elastic_policy: ElasticPolicy
    bound_s_per_step: float

    def to_json(self) -> dict[str, Any]:
        w = self.workload
        c, a, e = (self.results[k] for k in ("colocate", "async", "elastic"))
        out: dict[str, Any] = {"workload": w.name}
        for name, r in self.results.items():
            out[name] = _summary(r)
        out["colocate"]["rollout_share"] = round(c.rollout_share, 4)
        out["colocate"]["tail_share"] = round(c.tail_share, 4)
        out["speedup_vs_colocate"] = round(c.time_per_step_s / e.time_per_step_s, 3)
        out["speedup_vs_async"] = round(a.time_per_step_s / e.time_per_step_s, 3)
        out["best_async_split"] = {
            "rollout_devices": self.best_async_units * w.devices_per_unit,
            "train_devices": (w.num_units - self.best_async_units) * w.devices_per_unit,
        }
        out["async_sweep_time_per_step_s"] = {
            f"{n * w.devices_per_unit}/{(w.num_units - n) * w.devices_per_unit}": round(t, 1)
            for n, t in self.async_sweep.items()
        }
        out["staleness_bound"] = w.staleness_bound
        out["engine_slots"] = c.extra["engine_slots"]
        out["devices_per_unit"] = w.devices_per_unit
        out["trains_on_unfinished_executions"] = False
        ep = self.elastic_policy
        out["elastic_plan"] = {
            "home_rollout_devices": (ep.base_rollout_devices or 0) * w.devices_per_unit,
            "consolidates_tail": ep.consolidate,
        }
        b = self.bound_s_per_step
        out["critical_path_bound"] = {
            "time_per_step_s": round(b, 1),
            "max_speedup_vs_colocate": round(c.time_per_step_s / b, 3),
            "max_speedup_vs_async": round(a.time_per_step_s / b, 3),
        }
        return out


def plan_elastic(w: Workload, best_async_units: int) -> ElasticPolicy:
    """Size Elastic the way an operator sizes Async, from the same sweep: its home split is the best
    static split. It consolidates the tail (migrates live executions to lend engines) only when the
    rollout is KV-bound, i.e. one batch does not fit in the home split's slots; otherwise decode is
    bandwidth-bound, packing executions onto fewer engines slows them, and Elastic lends only an
    emptied rollout (no live execution left) to the trainer."""
    slots = _prepared(w)[1].engine_slots()
    return ElasticPolicy(
        staleness_bound=w.staleness_bound,
        base_rollout_devices=best_async_units,
        consolidate=w.executions_per_step > best_async_units * slots,
    )


def compare(w: Workload) -> Comparison:
    """Colocate, best Async split and Elastic on `w`. Elastic's home split is the best static split
    of the same sweep (the knowledge an operator sizing Async has; Elastic gets no sweep of its own)."""
    a, n, sweep = sweep_async(w)
    results = {
        "colocate": simulate(w, ColocatePolicy()),
        "async": a,
        "elastic": simulate(w, plan_elastic(w, n)),
    }
    return Comparison(w, results, n, sweep, plan_elastic(w, n), critical_path_bound(w))


def critical_path_bound(w: Workload) -> float:
    """Time per step no policy can beat on `w` at its staleness bound (sim/bound.py)."""
    execs, cost = _prepared(w)
    return critical_path_s_per_step(execs, cost, w.staleness_bound)


def predict(
    workload: Workload | str | Path,
    policy: str | None = "elastic",
    num_rollout_devices: int | None = None,
    measured: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The simulator's prediction for one policy: time_per_step_s, device_utilization,
    device_idle_fraction (= 1 - utilization), max_staleness, ...

    `workload` is a Workload, a workload YAML file, or a run YAML whose `scheduler.sim_workload`
    names one (relative to the run YAML); `policy` None means the run's `scheduler.policy` (else
    elastic). For `async` (and Elastic's home split), the split is `num_rollout_devices` if given
    (whole units), else the best split from a sweep. `measured` (the run's summary) is accepted for callers that pass it; the
    prediction does not use it, so predicted and measured stay independent."""
    del measured
    if not isinstance(workload, Workload):
        workload, policy = _workload_from_file(Path(workload), policy)
    w = workload
    policy = policy or "elastic"
    if policy == "colocate":
        r = simulate(w, ColocatePolicy())
    elif policy == "elastic":
        home = num_rollout_devices // w.devices_per_unit if num_rollout_devices else sweep_async(w)[1]
        r = simulate(w, plan_elastic(w, max(1, min(w.num_units - 1, home))))
    elif policy == "async":
        if num_rollout_devices is None:
            r, n, _ = sweep_async(w)
        else:
            n = max(1, min(w.num_units - 1, num_rollout_devices // w.devices_per_unit))
            r = simulate(w, AsyncPolicy(n, staleness_bound=w.staleness_bound))
        out = _summary(r)
        out["rollout_devices"] = n * w.devices_per_unit
        return out
    else:
        raise ValueError(f"unknown policy {policy!r}; choose colocate, async or elastic")
    return _summary(r)


def _workload_from_file(path: Path, policy: str | None) -> tuple[Workload, str | None]:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a YAML mapping")
    if "domains" in data:
        return Workload.model_validate(data), policy
    section = data.get("scheduler") or {}
    ref = section.get("sim_workload")
    if not ref:
        raise ValueError(
            f"{path} is a run config without scheduler.sim_workload; set it to a workload YAML "
            "(docs/simulator.md) that describes this deployment to get a prediction"
        )
    wpath = Path(ref) if Path(ref).is_absolute() else path.parent / ref
    return load_workload_file(wpath), policy or section.get("policy")
