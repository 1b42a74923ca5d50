"""A true lower bound of the simulator: the earliest time any policy can finish all training steps.

It prices with the engine's own functions (gyre.costmodel through `Workload.cost_model`), and only
ever drops costs, so every simulated run ends at or after it (tests/scheduler/test_sim_bound.py
checks every policy variant, with no tolerance):

- floor_i, one execution alone: per turn, prefill of its observation at `prefill_s`, then its
  generated tokens at `decode_step_s` of its own context after that prefill (the engine prices a
  turn at the decoding context of its engine, which includes this one), then its environment wait.
  No queueing, stall, migration, park or role change.
- A group (one task's executions) of batch k is scored at the earliest at
  A_k + min(max_i floor_i, min_i floor_i + train_unfinished_after_s), where A_k is the time batch k
  may be admitted: 0 for k <= bound, else the end of step k - bound - 1 (bound 0 for Colocate).
- A group trains at least min_i train_flops(final_i) (what its first finished execution carries;
  with no cut-off every execution in full), on the whole pool at `train_mfu`.
- Step k ends after its last group is scored and trained, after step k - 1, and after all training
  of steps 0..k on the whole pool:
  D_k = max(D_{k-1}, max_g S_g + min_g flops_g / F, sum_{j<=k} flops_j / F).

The bound is on the end of the last step (the makespan), not on the windowed time per step: a run
may be slow in its warm-up and fast afterwards, so no per-step bound follows from it.
"""

from __future__ import annotations

from gyre.workload import Workload
from services.scheduler.sim.sample import ExecutionPlan


def execution_floor_s(plan: ExecutionPlan, w: Workload) -> float:
    """Seconds one execution needs alone on an engine, priced as the engine prices it."""
    cost = w.cost_model()
    t = 0.0
    ctx = 0.0
    for obs, gen, env in zip(plan.obs, plan.gen, plan.env_s, strict=True):
        t += cost.prefill_s(obs, ctx)
        ctx += obs
        t += gen * cost.decode_step_s(ctx)
        ctx += gen
        t += env
    return t


def makespan_lower_bound_s(w: Workload, executions: list[list[ExecutionPlan]], bound: int) -> float:
    """Earliest end of the last training step any policy can reach (module docstring)."""
    cost = w.cost_model()
    full = cost.train_flops_per_s(w.num_devices)
    cut = w.service.train_unfinished_after_s
    done: list[float] = []
    cumulative = 0.0
    for k, batch in enumerate(executions):
        admitted = done[k - bound - 1] if k - bound - 1 >= 0 else 0.0
        groups: dict[int, list[ExecutionPlan]] = {}
        for p in batch:
            groups.setdefault(p.task, []).append(p)
        scored, flops = [], []
        for members in groups.values():
            floors = [execution_floor_s(p, w) for p in members]
            ready = max(floors) if cut is None else min(max(floors), min(floors) + cut)
            scored.append(admitted + ready)
            each = [cost.train_flops(p.final_context) for p in members]
            flops.append(sum(each) if cut is None else min(each))
        cumulative += sum(flops)
        prev = done[-1] if done else 0.0
        done.append(max(prev, max(scored) + min(flops) / full, cumulative / full))
    return done[-1]
