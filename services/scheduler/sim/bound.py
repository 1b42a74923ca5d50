"""Critical-path lower bound on time per step: what no policy can beat at a given staleness bound.

Per batch k: R_k = the slowest execution's latency with its engine to itself (every prefill and
decode at the uncontended memory-bound rate, every environment wait) and T_k = training batch k
on the whole pool at `train_mfu`. Batch k may start when step k - bound - 1 has finished
(`may_start_batch`), and step k starts when batch k is complete and step k - 1 has finished:

    D_k = max(D_{k-bound-1} + R_k, D_{k-1}) + T_k        (D_j = 0 for j < 0)

Any real schedule is slower: it pays role changes, weight syncs, migrations, shared engines and a
trainer that never has the whole pool while the next batch rolls out. Measured like `SimResult`:
(D_last - D_warmup) / (steps - warmup).
"""

from __future__ import annotations

from services.scheduler.sim.cost import CostModel
from services.scheduler.sim.sample import ExecutionPlan


def execution_floor_s(plan: ExecutionPlan, cost: CostModel) -> float:
    """Seconds one execution needs alone on an engine: prefill + uncontended decode + environment."""
    t = 0.0
    ctx = 0.0
    for obs, gen, env in zip(plan.obs, plan.gen, plan.env_s, strict=True):
        t += cost.prefill_s(obs, ctx)
        ctx += obs
        t += gen * cost.decode_step_s(ctx + gen / 2)  # mean context over the turn's decode
        ctx += gen
        t += env
    return t


def critical_path_s_per_step(executions: list[list[ExecutionPlan]], cost: CostModel, bound: int) -> float:
    """Lower bound on time per step for any policy at staleness `bound` (see module docstring)."""
    w = cost.workload
    done: list[float] = []
    full_pool = cost.train_flops_per_s(w.num_devices)
    for k, batch in enumerate(executions):
        rollout = max(execution_floor_s(p, cost) for p in batch)
        train = sum(cost.train_flops(p.final_context) for p in batch) / full_pool
        admitted = done[k - bound - 1] if k - bound - 1 >= 0 else 0.0
        done.append(max(admitted + rollout, done[k - 1] if k else 0.0) + train)
    t0 = done[w.warmup_steps - 1] if w.warmup_steps > 0 else 0.0
    return (done[-1] - t0) / (w.num_steps - w.warmup_steps)
