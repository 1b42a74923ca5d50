"""Sampling of the executions of every training step from a workload (seeded; identical for every policy)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.scheduler.sim.workload import Domain, Workload


@dataclass
class ExecutionPlan:
    """What one execution will do, turn by turn. obs[j] is read (prefilled) before turn j's generation
    (obs[0] is the prompt), gen[j] tokens are generated, then the environment takes env_s[j] seconds."""

    step: int
    task: int
    domain: str
    obs: list[float]
    gen: list[float]
    env_s: list[float]

    @property
    def final_context(self) -> float:
        return float(sum(self.obs) + sum(self.gen))


def _env_latencies(rng: np.random.Generator, d: Domain, n: int, scale: float) -> np.ndarray:
    if not d.environment or n == 0:
        return np.zeros(n)
    weights = np.array([c.weight for c in d.environment], dtype=float)
    which = rng.choice(len(d.environment), size=n, p=weights / weights.sum())
    out = np.empty(n)
    for i, c in enumerate(d.environment):
        mask = which == i
        k = int(mask.sum())
        if c.kind == "lognormal":
            out[mask] = c.a * np.exp(c.b * rng.standard_normal(k))
        elif c.kind == "uniform":
            out[mask] = rng.uniform(c.a, max(c.a, c.b), k)
        else:
            out[mask] = c.a
    return np.minimum(out * scale, d.env_cap_s)


def _shares(rng: np.random.Generator, n: int, sigma: float) -> np.ndarray:
    x = np.exp(sigma * rng.standard_normal(n)) if sigma > 0 else np.ones(n)
    return x / x.sum()


def sample_executions(w: Workload) -> list[list[ExecutionPlan]]:
    """Executions per step: [step][i], `tasks_per_step * group_size` each. Same seed, same trajectories."""
    rng = np.random.default_rng(w.seed)
    weights = np.array([d.weight for d in w.domains], dtype=float)
    steps: list[list[ExecutionPlan]] = []
    for step in range(w.num_steps):
        execs: list[ExecutionPlan] = []
        for task in range(w.tasks_per_step):
            d = w.domains[int(rng.choice(len(w.domains), p=weights / weights.sum()))]
            z_task = rng.standard_normal()
            env_scale = float(
                np.exp(d.task_env_scale_sigma * rng.standard_normal() - d.task_env_scale_sigma**2 / 2)
            )
            for _ in range(w.group_size):
                z = (
                    np.sqrt(d.group_correlation) * z_task
                    + np.sqrt(1 - d.group_correlation) * rng.standard_normal()
                )
                length = min(
                    d.context_cap_tokens, d.context_median_tokens * float(np.exp(d.context_sigma * z))
                )
                turns = max(1, round(length / d.tokens_per_turn))
                gen_total = length * float(
                    np.clip(
                        rng.beta(6, 6 / d.generated_fraction - 6) if d.generated_fraction < 1 else 1.0,
                        0.02,
                        1.0,
                    )
                )
                gen = gen_total * _shares(rng, turns, d.turn_size_sigma)
                obs = (length - gen_total) * _shares(rng, turns, d.turn_size_sigma)
                s_exec = d.execution_env_scale_sigma
                exec_scale = float(np.exp(s_exec * rng.standard_normal() - s_exec**2 / 2))
                env = _env_latencies(rng, d, turns, env_scale * exec_scale)
                env[-1] = 0.0
                execs.append(ExecutionPlan(step, task, d.name, obs.tolist(), gen.tolist(), env.tolist()))
        steps.append(execs)
    return steps
