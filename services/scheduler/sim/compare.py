"""Run the policies on one workload at equal work and compare them, over several seeds.

Rows (every one runs the same sampled executions of a seed):
- `colocate`: the whole pool alternates, with the workload's trainer and scoring semantics;
- `async`: the best fixed split of a sweep over every split (refined grid), with the same streaming
  trainer and partial-progress cut-off as Elastic: the strongest static baseline;
- `elastic`: ElasticPolicy with the same code and constants on every workload and no split input:
  its home split is chosen online from the load reports and step times
  (services/scheduler/split_meter.py), exactly as the live scheduler measures it. Nothing of the
  sweep reaches it (`elastic_policy` takes no split; a test holds that);
- `async_half`: the fixed split an operator gets without a sweep (half the pool rolling out, same
  trainer and partial progress as the others), so Elastic can be read against the default too;
- `async_phase_oracle`: the per-phase oracle on a drifting workload, an operator who re-tunes the
  fixed split at every drift phase to the split fastest over that phase in the sweep (hindsight),
  as one run that pays its re-splits (`retuned_async`; the best fixed run when that is faster, so on
  a stationary workload it is the `async` row). `vs_phase_oracle_stitched` compares with the older,
  unrealizable stitch of per-phase minima (`phase_oracle_time_per_step_s`);
- `async_reused` (with two or more seeds): Async at the split an operator tuned on another run and
  reused: per seed, the mean over the other seeds' best splits. The `async` row picks the fastest of
  a dozen runs of the same seed, so part of its lead over neighbouring splits is that seed's noise
  (winner's curse); this row is what a sweep buys on the next run. It is reported beside `async`,
  never instead of it (`vs_async_reused`);
- `paper_colocate`, `paper_async`: the baselines as the QwenGyre paper describes them (Async = half
  the pool rolling out, batch-synchronous trainer, no partial-progress scoring), so Gyre's figures
  can be read against the published 1.85x / 1.78x.

Work: every row trains every batch; with partial progress a row may train fewer tokens of a cut
execution, so each row reports `tokens_trained_per_step` and `generated_trained_share`.
`makespan_lower_bound_s` (sim/bound.py) is the earliest end of the last step any policy can reach
at the workload's bound; each row's `makespan_over_lower_bound` says how far above it the row ends,
which is also the largest makespan speedup any policy (Elastic included) could have over that row
(`makespan_speedup_ceiling`); `makespan_speedup` is Elastic's speedup on makespans over the same rows
(the time per step is windowed after the warm-up steps, which on a short run credits a row whose
warm-up ended late).
Ratios are time-per-step ratios (higher = Elastic faster), one per seed; `--seeds N` reports each as
a mean with a 95% bootstrap interval (scipy.stats.bootstrap, BCa, 2,000 resamples, seeded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from scipy import stats

from gyre.workload import ServiceSemantics, Workload, load_workload_file
from services.scheduler.policies import (
    AsyncPolicy,
    ColocatePolicy,
    ElasticPolicy,
    Policy,
    PoolSnapshot,
    Reassignment,
)
from services.scheduler.sim.bound import makespan_lower_bound_s
from services.scheduler.sim.engine import SimResult, Simulation
from services.scheduler.sim.sample import ExecutionPlan, sample_executions
from services.scheduler.split_meter import SplitMeter

# What the paper's baselines do: no streaming trainer, no partial progress (resize is moot for them).
PAPER_SEMANTICS = ServiceSemantics(
    trainer_resize="step", trainer_streaming=False, train_unfinished_after_s=None
)


def _prepared(w: Workload) -> tuple[list[list[ExecutionPlan]], int]:
    return _prepared_json(w.model_dump_json(exclude={"service"}))


@lru_cache(maxsize=16)
def _prepared_json(workload_json: str) -> tuple[list[list[ExecutionPlan]], int]:
    w = Workload.model_validate_json(workload_json)
    execs = sample_executions(w)
    flat = [e.final_context for step in execs for e in step]
    return execs, w.cost_model().engine_capacity(sum(flat) / len(flat))


def with_seed(w: Workload, seed: int) -> Workload:
    return w.model_copy(update={"seed": seed})


def with_semantics(w: Workload, sem: ServiceSemantics) -> Workload:
    return w.model_copy(update={"service": sem})


def simulate(
    w: Workload, policy: Policy, record_snapshots: bool = False, split_meter: SplitMeter | None = None
) -> SimResult:
    """One simulated run of `policy` on `w` (trajectories sampled once per workload and seed);
    `split_meter` replaces the shipped meter (studies only: scripts/elastic_first_move_bound.py)."""
    execs, capacity = _prepared(w)
    sim = Simulation(policy, w, execs, capacity, record_snapshots=record_snapshots, split_meter=split_meter)
    return sim.run()


def elastic_policy(w: Workload) -> ElasticPolicy:
    """Elastic as it runs live by default: the staleness bound and the role-change cost of the
    deployment, and no split: its home is measured online (split_meter.py)."""
    return ElasticPolicy(staleness_bound=w.staleness_bound, role_change_s=w.costs.elastic_role_change_s)


def elastic_policy_with_home(w: Workload, home_units: int) -> ElasticPolicy:
    """Elastic with a home split the operator fixed (`scheduler.async_rollout_devices`), for a
    prediction of a live run configured that way; never used by `compare`."""
    return ElasticPolicy(
        staleness_bound=w.staleness_bound,
        role_change_s=w.costs.elastic_role_change_s,
        home_rollout_devices=home_units,
    )


def sweep_async(w: Workload, coarse_points: int = 8) -> tuple[SimResult, int, dict[int, float]]:
    """Search the fixed split (rollout units 1..units-1): every split when there are at most
    `coarse_points`, else an evenly spaced grid refined around the best point down to single units.
    Returns the best run, its rollout-unit count and the time per step of every split tried."""
    runs = sweep_async_runs(w, coarse_points)
    best = min(runs, key=lambda n: (runs[n].time_per_step_s, n))
    return runs[best], best, {n: r.time_per_step_s for n, r in sorted(runs.items())}


def drift_phases(w: Workload) -> list[range]:
    """The measured steps (after warm-up) cut into phases: maximal runs of consecutive steps over
    which every domain's drift multipliers are equal. A stationary workload is one phase; a step of
    a linear ramp is a phase of its own."""
    steps = range(w.warmup_steps, w.num_steps)
    phases: list[range] = []
    start = steps.start
    for k in steps:
        if k > start and [d.drift_at(k) for d in w.domains] != [d.drift_at(k - 1) for d in w.domains]:
            phases.append(range(start, k))
            start = k
    if start < steps.stop:
        phases.append(range(start, steps.stop))
    return phases


def _step_s(r: SimResult, k: int) -> float:
    return r.step_done_s[k] - (r.step_done_s[k - 1] if k > 0 else 0.0)


def phase_oracle_time_per_step_s(w: Workload, runs: dict[int, SimResult]) -> float:
    """The per-phase oracle stitched from the sweep: for each drift phase the fastest of the swept
    fixed splits over that phase's steps, summed over the phases, per measured step. Not a run any
    operator can make: each phase is cut out of a different whole run, and on a ramp (a phase per
    step) it takes the fastest of ~10 runs step by step, so it collects the short half of every
    run's alternating long/short steps (the staleness bound pipelines them). Reported beside the
    re-tuned run (`retuned_async`) as `vs_phase_oracle_stitched`, never as the oracle itself."""
    total = 0.0
    phases = drift_phases(w)
    for phase in phases:
        total += min(sum(_step_s(r, k) for k in phase) for r in runs.values())
    return total / sum(len(p) for p in phases)


def oracle_phases(w: Workload) -> list[list[range]]:
    """The ways the per-phase oracle may cut the measured steps into phases to re-tune at: the drift
    phases (`drift_phases`), and, where a ramp makes phases of single steps, also quarters of the
    measured steps (an operator re-tuning every few steps of a ramp rather than at every one)."""
    phases = drift_phases(w)
    out = [phases]
    if any(len(p) == 1 for p in phases):
        steps = range(w.warmup_steps, w.num_steps)
        size = max(2, -(-len(steps) // 4))
        out.append([range(k, min(k + size, steps.stop)) for k in range(steps.start, steps.stop, size)])
    return out


def phase_splits(w: Workload, runs: dict[int, SimResult], phases: list[range]) -> list[int]:
    """Rollout units an operator who re-tunes at every one of `phases` sets while the trainer works
    on step k (index k): each phase's split is the swept split fastest over that phase's steps
    (chosen in hindsight, from whole runs); the warm-up steps run the first phase's split."""
    splits: list[int] = []
    for phase in phases:
        best = min(runs, key=lambda n: (sum(_step_s(runs[n], k) for k in phase), n))
        splits += [best] * (len(phase) + (phase.start if not splits else 0))
    return splits


class RetunedAsyncPolicy(AsyncPolicy):
    """Async re-split by an operator at each drift phase: `splits[v]` rollout units while weight
    version v is the newest (the trainer works on step v); the last entry holds afterwards. The
    simulator's per-phase oracle (a baseline, never Elastic's input): a real run, so every re-split
    pays its role changes and inherits the backlog of the phase before."""

    def __init__(self, splits: list[int], staleness_bound: int = 1) -> None:
        if not splits:
            raise ValueError("splits must name at least one split")
        super().__init__(splits[0], staleness_bound=staleness_bound)
        self.splits = list(splits)

    def plan(self, snapshot: PoolSnapshot) -> list[Reassignment]:
        self.num_rollout_devices = self.splits[min(snapshot.latest_version, len(self.splits) - 1)]
        return super().plan(snapshot)

    def describe(self) -> str:
        return f"async(re-tuned per phase: {self.splits})"


def retuned_async(w: Workload, runs: dict[int, SimResult]) -> SimResult:
    """The per-phase oracle as a run: Async re-split at every phase (for each way `oracle_phases`
    cuts the steps) to the split that was fastest over it in the sweep (`phase_splits`); the fastest
    of those runs and the best fixed run (an operator at their best keeps a split that beats
    re-tuning; a stationary workload gets the best fixed run)."""
    best = min(runs.values(), key=lambda r: r.time_per_step_s)
    for phases in oracle_phases(w):
        splits = phase_splits(w, runs, phases)
        if len(set(splits)) > 1:
            r = simulate(w, RetunedAsyncPolicy(splits, staleness_bound=w.staleness_bound))
            best = min(best, r, key=lambda x: x.time_per_step_s)
    return best


def sweep_async_runs(w: Workload, coarse_points: int = 8) -> dict[int, SimResult]:
    """Every fixed-split run `sweep_async` tries, by rollout-unit count."""
    times: dict[int, float] = {}
    runs: dict[int, SimResult] = {}

    def run(n: int) -> None:
        if n not in times and 1 <= n < w.num_units:
            runs[n] = simulate(w, AsyncPolicy(n, staleness_bound=w.staleness_bound))
            times[n] = runs[n].time_per_step_s

    stride = max(1, -(-(w.num_units - 1) // coarse_points))
    for n in range(1, w.num_units, stride):
        run(n)
    while stride > 1:
        best = min(times, key=lambda n: (times[n], n))
        stride = max(1, stride // 2)
        run(best - stride)
        run(best + stride)
    return runs


def _summary(r: SimResult) -> dict[str, Any]:
    return {
        "time_per_step_s": round(r.time_per_step_s, 1),
        "makespan_s": round(r.step_done_s[-1], 1),
        "tokens_trained_per_step": round(r.tokens_trained_per_step),
        "generated_trained_share": round(r.generated_trained_share, 4),
        "device_utilization": round(r.device_utilization, 4),
        "max_staleness": r.max_staleness,
        "kv_peak_share": round(r.kv_peak_share, 4),
        "num_migrations": r.num_migrations,
        "num_role_changes": r.num_role_changes,
        "num_parked": r.num_parked,
        "num_preemptions": r.num_preemptions,
    }


def _by_key(per_row: dict[str, float]) -> dict[str, float]:
    """A per-row makespan figure under the keys of `Comparison.ratios` (the best baseline: the faster
    of Async and Colocate, the smaller figure)."""
    return {
        "vs_colocate": per_row["colocate"],
        "vs_async": per_row["async"],
        "vs_async_half": per_row["async_half"],
        "vs_best_baseline": min(per_row["async"], per_row["colocate"]),
        "vs_phase_oracle": per_row["async_phase_oracle"],
        "vs_paper_colocate": per_row["paper_colocate"],
        "vs_paper_async": per_row["paper_async"],
    }


@dataclass
class Comparison:
    """Every row of one workload at one seed."""

    workload: Workload
    results: dict[str, SimResult]
    best_async_units: int
    async_sweep: dict[int, float]
    makespan_bound_s: float
    phase_oracle_stitched_s_per_step: float  # phase_oracle_time_per_step_s over the sweep

    def ratios(self) -> dict[str, float]:
        """Elastic's speedups (time per step of the other / Elastic's) at this seed."""
        e = self.results["elastic"].time_per_step_s
        best = min(self.results["async"].time_per_step_s, self.results["colocate"].time_per_step_s)
        return {
            "vs_colocate": self.results["colocate"].time_per_step_s / e,
            "vs_async": self.results["async"].time_per_step_s / e,
            "vs_async_half": self.results["async_half"].time_per_step_s / e,
            "vs_best_baseline": best / e,
            "vs_paper_colocate": self.results["paper_colocate"].time_per_step_s / e,
            "vs_paper_async": self.results["paper_async"].time_per_step_s / e,
            "vs_phase_oracle": self.results["async_phase_oracle"].time_per_step_s / e,
            "vs_phase_oracle_stitched": self.phase_oracle_stitched_s_per_step / e,
        }

    def makespan_ratios(self) -> dict[str, float]:
        """Elastic's makespan speedups (the other row's end of the last step over Elastic's), same keys
        as `ceilings`. The time per step is windowed after the warm-up steps, so on a short run it
        credits a row whose warm-up ended late; the makespan counts the whole run."""
        e = self.results["elastic"].step_done_s[-1]
        return _by_key({name: r.step_done_s[-1] / e for name, r in self.results.items()})

    def ceilings(self) -> dict[str, float]:
        """The largest makespan speedup any policy could have over each row: the row's makespan over
        the lower bound (`makespan_lower_bound_s`). Same keys as `ratios`."""
        return _by_key({name: r.step_done_s[-1] / self.makespan_bound_s for name, r in self.results.items()})

    def to_json(self) -> dict[str, Any]:
        w = self.workload
        out: dict[str, Any] = {"workload": w.name, "seed": w.seed}
        for name, r in self.results.items():
            out[name] = _summary(r)
        c = self.results["colocate"]
        out["colocate"]["rollout_share"] = round(c.rollout_share, 4)
        out["colocate"]["tail_share"] = round(c.tail_share, 4)
        out.update({f"speedup_{k}": round(v, 3) for k, v in self.ratios().items()})
        out["async_sweep_runs"] = len(self.async_sweep)
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
        out["service"] = w.service.model_dump()
        out["makespan_lower_bound_s"] = round(self.makespan_bound_s, 1)
        return out


def compare(w: Workload) -> Comparison:
    """Every row (module docstring) on `w` at its seed."""
    runs = sweep_async_runs(w)
    n = min(runs, key=lambda u: (runs[u].time_per_step_s, u))
    a, sweep = runs[n], {u: r.time_per_step_s for u, r in sorted(runs.items())}
    paper = with_semantics(w, PAPER_SEMANTICS)
    half = max(1, w.num_units // 2)
    results = {
        "colocate": simulate(w, ColocatePolicy()),
        "async": a,
        "async_half": simulate(w, AsyncPolicy(half, staleness_bound=w.staleness_bound)),
        "async_phase_oracle": retuned_async(w, runs),
        "elastic": simulate(w, elastic_policy(w)),
        "paper_colocate": simulate(paper, ColocatePolicy()),
        "paper_async": simulate(paper, AsyncPolicy(half, staleness_bound=w.staleness_bound)),
    }
    execs, _ = _prepared(w)
    return Comparison(
        w, results, n, sweep, makespan_lower_bound_s(w, execs, w.staleness_bound),
        phase_oracle_time_per_step_s(w, runs),
    )  # fmt: skip


def interval(values: list[float], seed: int = 0) -> dict[str, float]:
    """Mean and 95% bootstrap interval (BCa; percentile when BCa is undefined) of `values`."""
    x = np.asarray(values, dtype=float)
    mean = float(x.mean())
    if len(x) < 2 or float(x.std()) == 0.0:
        return {"mean": round(mean, 3), "low": round(mean, 3), "high": round(mean, 3)}
    rng = np.random.default_rng(seed)
    res = stats.bootstrap(
        (x,), np.mean, confidence_level=0.95, n_resamples=2000, method="BCa", random_state=rng
    )
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (np.isfinite(low) and np.isfinite(high)):
        res = stats.bootstrap(
            (x,), np.mean, confidence_level=0.95, n_resamples=2000, method="percentile", random_state=rng
        )
        low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return {"mean": round(mean, 3), "low": round(low, 3), "high": round(high, 3)}


def reused_split_s_per_step(per_seed: list[Comparison]) -> list[float]:
    """Per seed, the mean time per step of Async at each other seed's best split: the split tuned on
    one run and reused on the next (module docstring, `async_reused`). A split the seed's own sweep
    ran is read from it; any other is simulated once. Empty with fewer than two seeds."""
    if len(per_seed) < 2:
        return []
    out = []
    for i, c in enumerate(per_seed):
        known = dict(c.async_sweep)
        times = []
        for j, other in enumerate(per_seed):
            if j == i:
                continue
            n = other.best_async_units
            if n not in known:
                w = c.workload
                known[n] = simulate(w, AsyncPolicy(n, staleness_bound=w.staleness_bound)).time_per_step_s
            times.append(known[n])
        out.append(float(np.mean(times)))
    return out


@dataclass
class SeedComparison:
    """Every row of one workload over several seeds (`reused_s_per_step`: the `async_reused` row,
    computed on construction)."""

    workload: Workload
    per_seed: list[Comparison] = field(default_factory=list)
    reused_s_per_step: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.reused_s_per_step:
            self.reused_s_per_step = reused_split_s_per_step(self.per_seed)

    def to_json(self) -> dict[str, Any]:
        w = self.workload
        out: dict[str, Any] = {
            "workload": w.name,
            "description": w.description,
            "seeds": [c.workload.seed for c in self.per_seed],
            "service": w.service.model_dump(),
        }
        names = list(self.per_seed[0].results)
        for name in names:
            runs = [c.results[name] for c in self.per_seed]
            out[name] = {
                "time_per_step_s": interval([r.time_per_step_s for r in runs]),
                "makespan_over_lower_bound": round(
                    float(
                        np.mean(
                            [
                                r.step_done_s[-1] / c.makespan_bound_s
                                for r, c in zip(runs, self.per_seed, strict=True)
                            ]
                        )
                    ),
                    3,
                ),
                "tokens_trained_per_step": round(float(np.mean([r.tokens_trained_per_step for r in runs]))),
                "generated_trained_share": round(
                    float(np.mean([r.generated_trained_share for r in runs])), 4
                ),
                "device_utilization": round(float(np.mean([r.device_utilization for r in runs])), 4),
                "max_staleness": max(r.max_staleness for r in runs),
                "kv_peak_share": round(max(r.kv_peak_share for r in runs), 4),
                "num_migrations": round(float(np.mean([r.num_migrations for r in runs])), 1),
                "num_preemptions": round(float(np.mean([r.num_preemptions for r in runs])), 1),
            }
        colocate = [c.results["colocate"] for c in self.per_seed]
        out["colocate"]["rollout_share"] = round(float(np.mean([r.rollout_share for r in colocate])), 4)
        out["colocate"]["tail_share"] = round(float(np.mean([r.tail_share for r in colocate])), 4)
        out["best_async_rollout_devices"] = [c.best_async_units * w.devices_per_unit for c in self.per_seed]
        # Whole simulated runs the baseline's oracle took per seed (Elastic takes one).
        out["async_sweep_runs"] = [len(c.async_sweep) for c in self.per_seed]
        out["drift_phases"] = [[p.start, p.stop - 1] for p in drift_phases(w)]
        # What the per-phase oracle ran per seed (a re-tuned split list, or the best fixed split).
        out["phase_oracle_policy"] = [c.results["async_phase_oracle"].policy for c in self.per_seed]
        c0 = self.per_seed[0]
        keys = list(c0.ratios())
        out["speedup"] = {k: interval([c.ratios()[k] for c in self.per_seed]) for k in keys}
        out["speedup_per_seed"] = {k: [round(c.ratios()[k], 3) for c in self.per_seed] for k in keys}
        if self.reused_s_per_step:
            reused = [
                t / c.results["elastic"].time_per_step_s
                for t, c in zip(self.reused_s_per_step, self.per_seed, strict=True)
            ]
            out["async_reused"] = {
                "time_per_step_s": interval(self.reused_s_per_step),
                "rollout_devices_tuned_per_seed": out["best_async_rollout_devices"],
            }
            out["speedup"]["vs_async_reused"] = interval(reused)
            out["speedup_per_seed"]["vs_async_reused"] = [round(r, 3) for r in reused]
        speedups = [c.makespan_ratios() for c in self.per_seed]
        ceilings = [c.ceilings() for c in self.per_seed]
        out["makespan_speedup"] = {k: interval([x[k] for x in speedups]) for k in speedups[0]}
        out["makespan_speedup_ceiling"] = {k: interval([x[k] for x in ceilings]) for k in ceilings[0]}
        return out


def compare_seeds(w: Workload, num_seeds: int) -> SeedComparison:
    """`compare` at seeds w.seed, w.seed + 1, ..., w.seed + num_seeds - 1."""
    if num_seeds < 1:
        raise ValueError(f"num_seeds must be >= 1, got {num_seeds}")
    return SeedComparison(w, [compare(with_seed(w, w.seed + i)) for i in range(num_seeds)])


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
    elastic). For `async` the split is `num_rollout_devices` if given (whole units), else the best
    split of a sweep. `measured` (the run's summary) is accepted for callers that pass it; the
    prediction does not use it, so predicted and measured stay independent. For `elastic` the home
    split is `num_rollout_devices` when the run fixed one (as the live policy gets it), else measured
    online as in `compare`."""
    del measured
    if not isinstance(workload, Workload):
        workload, policy = _workload_from_file(Path(workload), policy)
    w = workload
    policy = policy or "elastic"
    if policy == "colocate":
        r = simulate(w, ColocatePolicy())
    elif policy == "elastic":
        if num_rollout_devices is None:
            r = simulate(w, elastic_policy(w))
        else:
            home = max(1, min(w.num_units - 1, num_rollout_devices // w.devices_per_unit))
            r = simulate(w, elastic_policy_with_home(w, home))
    elif policy == "async":
        if num_rollout_devices is None:
            r, n, _ = sweep_async(w)
        else:
            n = max(1, min(w.num_units - 1, num_rollout_devices // w.devices_per_unit))
            r = simulate(w, AsyncPolicy(n, staleness_bound=w.staleness_bound))
        out = _summary(r)
        out["device_idle_fraction"] = round(1 - r.device_utilization, 4)
        out["rollout_devices"] = n * w.devices_per_unit
        return out
    else:
        raise ValueError(f"unknown policy {policy!r}; choose colocate, async or elastic")
    out = _summary(r)
    out["device_idle_fraction"] = round(1 - r.device_utilization, 4)
    return out


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
