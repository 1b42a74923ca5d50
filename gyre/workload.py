"""Workload and cluster description: the documented YAML schema (see docs/simulator.md), and the seeded
sampler of every execution's turns. Pure data, shared by the cluster simulator (services/scheduler/sim),
the `workload` environment of the rollout and paced devices (gyre/pacing.py): one file drives all three.

Tags in comments say where a default comes from (docs/cost-model-sources.md, cited as "sources §n"):
[S] the number is in a public source (named), [D] derived from published specs by stated arithmetic,
[G] a guess or a modelling choice, fitted where it says so. Change any of them in a workload file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gyre.costmodel import (
    DEFAULT_COSTS,
    H200,
    MODEL_8B,
    MODEL_32B,
    CostModel,
    CostSpec,
    HardwareSpec,
    ModelSpec,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LatencyComponent(_Strict):
    """One component of the environment-latency mixture (seconds per environment action)."""

    weight: float = Field(..., gt=0, description="Relative probability of this component.")
    kind: Literal["lognormal", "uniform", "constant"] = Field(..., description="Distribution family.")
    a: float = Field(..., ge=0, description="lognormal: median s; uniform: low s; constant: value s.")
    b: float = Field(
        default=0.0, ge=0, description="lognormal: sigma of log; uniform: high s; constant: unused."
    )


class SchedulePoint(_Strict):
    """A domain's drift at one training step: multipliers on its base values (1 = unchanged).

    Between two points every multiplier is linear in the step; before the first point and after the
    last it holds. This describes length growth over training (RL responses lengthen as the policy
    learns to reason longer), curricula (domain weights shifting) and phase changes (two points one
    step apart).
    """

    step: int = Field(..., ge=0, description="Training step (batch index) this point applies to.")
    context_scale: float = Field(
        default=1.0, gt=0, description="Multiplier on `context_median_tokens` (the cap still applies)."
    )
    turns_scale: float = Field(
        default=1.0,
        gt=0,
        description="Multiplier on the turn count an execution's length gives (more, shorter turns).",
    )
    weight_scale: float = Field(default=1.0, gt=0, description="Multiplier on the domain's `weight`.")


class Drift(_Strict):
    """The multipliers of one domain at one step (interpolated from its schedule)."""

    context: float = 1.0
    turns: float = 1.0
    weight: float = 1.0


class Domain(_Strict):
    """A family of tasks: how long its executions are, how many turns, how slow its environment."""

    name: str = Field(..., description="Domain name, for reports.")
    weight: float = Field(
        default=1.0, gt=0, description="Share of the tasks of a step drawn from this domain."
    )
    context_median_tokens: float = Field(
        ..., gt=0, description="Median final context of an execution (tokens)."
    )
    context_sigma: float = Field(..., ge=0, description="Sigma of log final context (LogNormal).")
    context_cap_tokens: float = Field(
        ..., gt=0, description="Hard cap on final context (tokens); longer ones are truncated."
    )
    group_correlation: float = Field(
        default=0.5, ge=0, le=1, description="Share of log-length variance common to a task's group (rho)."
    )
    generated_fraction: float = Field(
        default=0.3,
        gt=0,
        le=1,
        description="Mean share of the final context the model generated (rest: prompt + observations).",
    )
    tokens_per_turn: float = Field(
        ..., gt=0, description="Mean tokens (generated + observed) per turn; sets the turn count."
    )
    turn_size_sigma: float = Field(
        default=1.0, ge=0, description="Sigma of log per-turn size (LogNormal shares)."
    )
    environment: list[LatencyComponent] = Field(
        default_factory=list,
        description="Environment latency mixture after each turn; empty = no environment.",
    )
    task_env_scale_sigma: float = Field(
        default=0.0,
        ge=0,
        description="Sigma of a per-task LogNormal(1) multiplier on every environment latency.",
    )
    execution_env_scale_sigma: float = Field(
        default=0.0,
        ge=0,
        description="Sigma of a per-execution LogNormal(1) multiplier on its environment latencies.",
    )
    env_cap_s: float = Field(
        default=1800.0, gt=0, description="Tool timeout: no environment action lasts longer (s)."
    )
    schedule: list[SchedulePoint] = Field(
        default_factory=list,
        description="Drift over training: multipliers at given steps, piecewise-linear between them; "
        "empty = stationary.",
    )

    @model_validator(mode="after")
    def _check_schedule(self) -> Domain:
        steps = [p.step for p in self.schedule]
        if steps != sorted(set(steps)):
            raise ValueError(f"domain {self.name!r}: schedule steps must be strictly increasing, got {steps}")
        return self

    def drift_at(self, step: int) -> Drift:
        """The schedule's multipliers at `step` (linear between points, held outside them)."""
        pts = self.schedule
        if not pts:
            return Drift()
        if step <= pts[0].step:
            p = pts[0]
            return Drift(context=p.context_scale, turns=p.turns_scale, weight=p.weight_scale)
        for a, b in zip(pts, pts[1:], strict=False):
            if step <= b.step:
                f = (step - a.step) / (b.step - a.step)
                return Drift(
                    context=a.context_scale + f * (b.context_scale - a.context_scale),
                    turns=a.turns_scale + f * (b.turns_scale - a.turns_scale),
                    weight=a.weight_scale + f * (b.weight_scale - a.weight_scale),
                )
        p = pts[-1]
        return Drift(context=p.context_scale, turns=p.turns_scale, weight=p.weight_scale)


class ServiceSemantics(_Strict):
    """What the live services do, as the simulator models it (defaults: what they do today)."""

    trainer_resize: Literal["microbatch", "step"] = Field(
        default="microbatch",
        description=(
            "When the trainer's data-parallel group changes size: 'microbatch' at the next micro-batch boundary "
            "(the live trainer streams a step in micro-batches), 'step' only between optimizer steps."
        ),
    )
    trainer_streaming: bool = Field(
        default=True,
        description=(
            "The trainer trains a step's groups as they are scored (live: it pulls packed batches as they are "
            "ready); false = batch-synchronous, step k starts once all of batch k is scored."
        ),
    )
    train_unfinished_after_s: float | None = Field(
        default=None,
        ge=0,
        description=(
            "As trajectory.train_unfinished_after_s: seconds after the first execution of a group ended after which "
            "its unfinished executions are scored from the tokens they have so far (they keep running; later tokens "
            "are not trained). Unset = wait for every execution."
        ),
    )


class Workload(_Strict):
    """A whole simulated job: cluster, model, batch shape, task domains and costs."""

    name: str = Field(..., description="Workload name.")
    description: str = Field(default="", description="One line for reports.")
    num_devices: int = Field(default=64, gt=0, description="Accelerators in the pool.")
    devices_per_unit: int = Field(
        default=4, gt=0, description="Devices per scheduling unit = one inference engine (TP size)."
    )
    tasks_per_step: int = Field(default=8, gt=0, description="Tasks (prompts) per training step.")
    group_size: int = Field(default=8, gt=0, description="Executions per task (GRPO group).")
    num_steps: int = Field(default=8, gt=1, description="Training steps simulated.")
    warmup_steps: int = Field(
        default=2, ge=0, description="Steps excluded from time-per-step (pipeline fill)."
    )
    staleness_bound: int = Field(
        default=1, ge=0, description="Shared by async and elastic; colocate is 0 by construction."
    )
    seed: int = Field(
        default=0,
        ge=0,
        description="Seed of the trajectory sampler; every policy sees the same trajectories.",
    )
    domains: list[Domain] = Field(..., min_length=1, description="Task families; tasks are split by weight.")
    model: ModelSpec
    hardware: HardwareSpec
    costs: CostSpec = Field(default_factory=CostSpec)
    service: ServiceSemantics = Field(
        default_factory=ServiceSemantics, description="Trainer and scoring semantics of the live services."
    )

    @model_validator(mode="after")
    def _check(self) -> Workload:
        if self.num_devices % self.devices_per_unit:
            raise ValueError(
                f"num_devices ({self.num_devices}) must be a multiple of devices_per_unit ({self.devices_per_unit})"
            )
        if self.num_devices // self.devices_per_unit < 2:
            raise ValueError("need at least 2 scheduling units (num_devices / devices_per_unit >= 2)")
        if self.warmup_steps >= self.num_steps - 1:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must be < num_steps - 1 ({self.num_steps - 1})"
            )
        cost = self.cost_model()
        if cost.kv_budget_bytes() <= 0:
            raise ValueError("model weights do not fit on one engine unit; raise devices_per_unit")
        longest = max(d.context_cap_tokens for d in self.domains)
        if cost.kv_bytes(longest) > cost.kv_budget_bytes():
            raise ValueError(
                f"the KV cache of one {longest:.0f}-token execution ({cost.kv_bytes(longest) / 1e9:.0f} GB) does not fit "
                f"on one engine unit ({cost.kv_budget_bytes() / 1e9:.0f} GB); raise devices_per_unit or lower "
                "context_cap_tokens"
            )
        return self

    def cost_model(self) -> CostModel:
        """The runtime cost model (gyre.costmodel) of this cluster."""
        return CostModel(self.model, self.hardware, self.costs, self.devices_per_unit)

    @property
    def num_units(self) -> int:
        return self.num_devices // self.devices_per_unit

    @property
    def executions_per_step(self) -> int:
        return self.tasks_per_step * self.group_size


def load_workload_file(path: str | Path) -> Workload:
    """Parse a workload YAML file (schema: `Workload`); errors name the field."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"workload file {path} must hold a mapping")
    return Workload.model_validate(data)


# Environment mixture [S-informed G, sources §7]: 80% file edits/greps LogNormal(0.4 s, 0.6) (Daytona
# 0.26-0.6 s/action), 18% test/build runs Uniform(10, 60) s, 2% long experiments LogNormal(300 s, 1.0).
AGENT_ENV = [
    LatencyComponent(weight=0.80, kind="lognormal", a=0.4, b=0.6),
    LatencyComponent(weight=0.18, kind="uniform", a=10.0, b=60.0),
    LatencyComponent(weight=0.02, kind="lognormal", a=300.0, b=1.0),
]

XLONG = Workload(
    name="xlong",
    description="QwenGyre setting: ~700K tokens/rollout (cap 1M), hundreds of turns, 64 H200, 32B model",
    num_devices=64,  # [S: the brief / paper setting]
    devices_per_unit=4,  # [D] TP=4: 564 GB holds 64 GB weights + ~4 sequences at the time-averaged 350K context
    tasks_per_step=8,  # [G] 8 tasks x 8 samples (GRPO n=8-16, sources §8)
    group_size=8,
    num_steps=8,
    warmup_steps=2,
    staleness_bound=1,
    domains=[
        Domain(
            name="long-horizon-agent",
            # [G, fitted to the brief]: LogNormal(median 600K, sigma 0.5) capped at 1M gives mean ~650-700K.
            context_median_tokens=600_000,
            context_sigma=0.5,
            context_cap_tokens=1_000_000,
            group_correlation=0.5,  # [S qualitative: Seer, same-prompt lengths similar; value G]
            generated_fraction=0.3,  # [G, sources §9]
            tokens_per_turn=2_500,  # [G] -> ~270 turns on average (KLong: 115-733 assistant turns [S])
            turn_size_sigma=1.0,  # [G]
            environment=AGENT_ENV,
            # [G, fitted]: per-task (slow test suites) and per-execution (an agent stuck in long runs)
            # environment slowness; chosen so that under colocate the last 10% of executions take >= 40% of
            # rollout time (Seer: up to 50% [S]) and rollout is 70-90% of the step (Seer, RollPacker [S]).
            task_env_scale_sigma=0.4,
            execution_env_scale_sigma=1.2,
            env_cap_s=1800.0,  # [G] tool timeout
        )
    ],
    model=MODEL_32B,
    hardware=H200,
    costs=DEFAULT_COSTS,
)

REASONING = Workload(
    name="reasoning",
    description="Single-turn math/code reasoning: median 8K generated tokens, cap 32K, 8B model, 64 H200",
    num_devices=64,
    devices_per_unit=1,  # [D] 16 GB of weights fit on one H200
    tasks_per_step=32,  # [G] 32 prompts x 16 samples (AReaL/DAPO-like)
    group_size=16,
    num_steps=10,
    warmup_steps=2,
    staleness_bound=1,
    domains=[
        Domain(
            name="reasoning",
            # [G, informed by S: p99/median ~10x (Laminar), ~97% below 80K of a 160K cap (verl recipe)]
            context_median_tokens=8_000,
            context_sigma=0.8,
            context_cap_tokens=32_768,
            group_correlation=0.5,
            generated_fraction=0.95,  # [G] prompt is short
            tokens_per_turn=1e9,  # one turn
            turn_size_sigma=0.0,
            environment=[],
        )
    ],
    model=MODEL_8B,
    hardware=H200,
    costs=DEFAULT_COSTS,
)

MIXED = Workload(
    name="mixed",
    description="Mixed domains: half reasoning (8K), half medium agentic (100K, 40 turns); 32B model, 64 H200",
    num_devices=64,
    devices_per_unit=4,
    tasks_per_step=16,
    group_size=8,
    num_steps=8,
    warmup_steps=2,
    staleness_bound=1,
    domains=[
        Domain(
            name="reasoning",
            context_median_tokens=8_000,
            context_sigma=0.8,
            context_cap_tokens=32_768,
            generated_fraction=0.95,
            tokens_per_turn=1e9,
            turn_size_sigma=0.0,
            environment=[],
        ),
        Domain(
            name="swe-agent",
            # [G, informed by S: Nebius SWE RL contexts over 100K; DeepSWE Qwen3-32B]
            context_median_tokens=100_000,
            context_sigma=0.6,
            context_cap_tokens=256_000,
            generated_fraction=0.3,
            tokens_per_turn=2_500,
            environment=AGENT_ENV,
            task_env_scale_sigma=0.4,  # [G] as xlong
            execution_env_scale_sigma=1.2,  # [G] as xlong
        ),
    ],
    model=MODEL_32B,
    hardware=H200,
    costs=DEFAULT_COSTS,
)

BUILTIN_WORKLOADS: dict[str, Workload] = {w.name: w for w in (XLONG, REASONING, MIXED)}


def builtin(name: str) -> Workload:
    """A built-in workload by name; unknown names list the choices."""
    try:
        return BUILTIN_WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; built-ins: {', '.join(BUILTIN_WORKLOADS)}") from None


# --- sampling of the executions (seeded; identical for every policy and for the live services) ---------
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
    steps: list[list[ExecutionPlan]] = []
    for step in range(w.num_steps):
        drift = [d.drift_at(step) for d in w.domains]
        weights = np.array([d.weight * x.weight for d, x in zip(w.domains, drift, strict=True)], dtype=float)
        execs: list[ExecutionPlan] = []
        for task in range(w.tasks_per_step):
            which = int(rng.choice(len(w.domains), p=weights / weights.sum()))
            d, x = w.domains[which], drift[which]
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
                    d.context_cap_tokens,
                    d.context_median_tokens * x.context * float(np.exp(d.context_sigma * z)),
                )
                turns = max(1, round(x.turns * length / d.tokens_per_turn))
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
