"""Paced devices: a logical device that takes as long as the modelled accelerator would (scaled).

With `devices.pacing.enabled`, the rollout's torch engine and the trainer time every decode,
prefill, migration, training micro-batch, weight sync and role change by the cost model of
`gyre/costmodel.py` (the simulator's), priced with the model, hardware, costs and
`devices_per_unit` of a workload file (docs/simulator.md): each logical device of the run stands
for one scheduling unit of that workload. The real computation runs; the rest of the modelled
interval is waited with `asyncio.sleep` (never a busy loop). Every modelled duration is divided by
`time_scale` (modelled seconds per wall-clock second), so a CPU machine runs a workload as a
miniature cluster and the simulator's prediction for that file can be checked against a
measurement (`gyre bench elastic`).

Guarantees: with pacing off, `Pacer.wait` requests no wait and returns at once, and no duration is
computed from the cost model, so GPU runs are never slowed. With pacing on, a wait never ends
before `started + modelled_s / time_scale` on the monotonic clock (unless cancelled), and it never
sleeps when the real computation already took longer than that. Units: seconds (modelled unless
named `wall`), tokens, FLOPs.

How a generation is priced (as the simulator prices a turn, `services/scheduler/sim/engine.py`):
prefill of the turn's new tokens on top of its context, then its generated tokens at the engine's
memory-bound decode step time for every context decoding on that engine when the turn starts
(quasi-static). The modelled token counts of a turn come from the `workload` environment, which
sets them per execution (`Pacer.turns`) from the same sampler as the simulator; a request no
environment describes is priced from its real token counts times `tokens_per_live_token`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gyre.costmodel import CostModel


class _Config(BaseModel):
    # As gyre.config.ConfigModel (unknown keys are errors); gyre.config imports this module.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class PacingConfig(_Config):
    """How logical devices are paced (off by default: nothing is slowed)."""

    enabled: bool = Field(
        False,
        description="Pace every logical device by the cost model (CPU miniature clusters); off: no wait at all.",
    )
    time_scale: float = Field(
        1.0,
        gt=0,
        description="Modelled seconds per wall-clock second: 100 makes a modelled 100 s decode take 1 s of wall time.",
    )
    workload_file: Path | None = Field(
        None,
        description=(
            "Workload YAML (docs/simulator.md) whose model, hardware, costs and devices_per_unit price each "
            "device (one logical device = one scheduling unit of it); the rollout's `workload` environment "
            "draws its turns from the same file. Required when enabled."
        ),
    )
    switch_costs: Literal["per_device", "whole_pool"] = Field(
        "per_device",
        description=(
            "Role-change prices, as the simulator charges each policy: 'per_device' (async, elastic) = "
            "costs.elastic_role_change_s per device handed over and costs.weight_sync_s per new weight version "
            "on each engine; 'whole_pool' (colocate) = costs.switch_rollout_to_train_s or "
            "switch_train_to_rollout_s per device switched, no separate weight sync (the switch back refits)."
        ),
    )
    tokens_per_live_token: float = Field(
        1.0,
        gt=0,
        description="Modelled tokens one real token stands for, in requests no workload environment describes.",
    )
    busy_log: bool = Field(
        True,
        description=(
            "Append each device's busy intervals (generating or training; wall clock; paced or not) to "
            "<run_dir>/pacing/<worker>.jsonl, so a run's idle fraction can be measured as the simulator "
            "defines it (busy-based) and the report shows busy time next to leased time."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> PacingConfig:
        if self.enabled and self.workload_file is None:
            raise ValueError(
                "devices.pacing.enabled needs devices.pacing.workload_file (the cost model's numbers)"
            )
        return self


class DevicesConfig(_Config):
    """The devices of the pool, as every worker sees them (the `devices:` section)."""

    pacing: PacingConfig = Field(
        default_factory=lambda: PacingConfig.model_validate({}),
        description="Paced devices (gyre/pacing.py); off by default.",
    )


@dataclass(frozen=True)
class ModeledTurn:
    """One LLM call as the workload models it (tokens): the context already cached before the call,
    the new tokens it prefills, and the tokens it generates."""

    context_tokens: float
    new_tokens: float
    gen_tokens: float


@dataclass(frozen=True)
class Wait:
    """One wait requested of the pacer: what, the modelled seconds, and the wall seconds still to wait
    after the real work (0 when the work took longer)."""

    what: str
    modeled_s: float
    wall_s: float


Sleep = Callable[[float], Awaitable[None]]


class Pacer:
    """The cost model of one worker's paced devices. `clock` and `sleep` are the monotonic clock and
    the sleep used (tests pass recording ones); `waits` keeps the last 10,000 waits requested."""

    def __init__(
        self,
        cfg: PacingConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        busy_log_path: Path | None = None,
    ) -> None:
        self.cfg = cfg or PacingConfig.model_validate({})
        self.clock, self.sleep = clock, sleep
        self.waits: deque[Wait] = deque(maxlen=10_000)
        self.turns: dict[str, ModeledTurn] = {}
        self.cost: CostModel | None = None
        self.group_size = 1
        self.mean_execution_train_flops = 0.0
        self._busy_path = busy_log_path if self.cfg.busy_log else None
        if self.cfg.enabled:
            from gyre.workload import load_workload_file, sample_executions

            assert self.cfg.workload_file is not None
            w = load_workload_file(self.cfg.workload_file)
            self.workload = w
            self.cost = w.cost_model()
            self.group_size = w.group_size
            plans = [e for step in sample_executions(w) for e in step]
            self.mean_execution_train_flops = sum(
                self.cost.train_flops(e.final_context) for e in plans
            ) / len(plans)

    @property
    def enabled(self) -> bool:
        return self.cost is not None

    # -- modelled durations (seconds of the modelled accelerator) ----------------------------------
    def turn_of(
        self, execution_id: str, prompt_tokens: int, max_tokens: int, token_offset: int
    ) -> ModeledTurn:
        """The modelled turn of a request: the workload environment's (`set_turn`), the part of it still
        to generate when the request resumes a migrated one (`token_offset` > 0), else the real counts
        times `tokens_per_live_token`."""
        turn = self.turns.get(execution_id) if execution_id else None
        if turn is None:
            k = self.cfg.tokens_per_live_token
            new = 0 if token_offset else prompt_tokens
            return ModeledTurn((prompt_tokens - new) * k, new * k, max_tokens * k)
        if token_offset <= 0:
            return turn
        done = token_offset / (token_offset + max_tokens)
        return ModeledTurn(
            turn.context_tokens + turn.new_tokens + done * turn.gen_tokens, 0.0, (1 - done) * turn.gen_tokens
        )

    def generation_s(self, turn: ModeledTurn, decoding_context: float, resumed: bool = False) -> float:
        """A call on an engine whose other decoding sequences hold `decoding_context` modelled tokens:
        its KV copied in (resumed after a migration) or its new tokens prefilled, then its generated
        tokens at the decode step time of the engine with it (as the simulator prices a turn)."""
        assert self.cost is not None
        c = self.cost
        ctx = turn.context_tokens + turn.new_tokens
        start = (
            c.migration_s(turn.context_tokens)
            if resumed
            else c.prefill_s(turn.new_tokens, turn.context_tokens)
        )
        return start + turn.gen_tokens * c.decode_step_s(decoding_context + ctx)

    def train_s(self, num_groups: float, num_devices: int) -> float:
        """Training `num_groups` groups (each `group_size` executions of the workload's mean training
        FLOPs) on `num_devices` logical devices (each one scheduling unit)."""
        assert self.cost is not None
        flops = num_groups * self.group_size * self.mean_execution_train_flops
        return flops / self.cost.train_flops_per_s(max(1, num_devices) * self.cost.devices_per_unit)

    def role_change_s(self, to_role: Literal["train", "rollout"]) -> float:
        """One device handed over to `to_role` (see `switch_costs`)."""
        assert self.cost is not None
        c = self.cost.costs
        if self.cfg.switch_costs == "whole_pool":
            return c.switch_rollout_to_train_s if to_role == "train" else c.switch_train_to_rollout_s
        return c.elastic_role_change_s

    def weight_sync_s(self) -> float:
        """An engine switching to a new weight version (0 under whole_pool switches: the switch refits)."""
        assert self.cost is not None
        return 0.0 if self.cfg.switch_costs == "whole_pool" else self.cost.costs.weight_sync_s

    # -- waiting -----------------------------------------------------------------------------------
    def deadline(self, started: float, modeled_s: float) -> float:
        """The monotonic time at which `modeled_s` modelled seconds begun at `started` are over."""
        return started + modeled_s / self.cfg.time_scale

    def request(self, what: str, started: float, modeled_s: float) -> float:
        """Record a wait of `modeled_s` modelled seconds begun at `started`; return the wall seconds left."""
        wall = max(0.0, self.deadline(started, modeled_s) - self.clock())
        self.waits.append(Wait(what, modeled_s, wall))
        return wall

    async def wait(self, what: str, started: float, modeled_s: float | Callable[[], float]) -> float:
        """Sleep until `modeled_s` (a number, or a function called only when pacing is on) modelled
        seconds have passed since `started` (monotonic). Off: returns 0 at once, requests nothing."""
        if not self.enabled:
            return 0.0
        wall = self.request(what, started, modeled_s() if callable(modeled_s) else modeled_s)
        if wall > 0:
            await self.sleep(wall)
        return wall

    # -- busy time (the simulator's utilization) -------------------------------------------------------
    def busy(self, role: str, device: str, start: float, end: float, devices: int = 1) -> None:
        """Log that `devices` devices (of `device`) were busy in `role` from `start` to `end` (monotonic;
        written as unix time), paced or not: unpaced, the interval is the real computation's. No-op
        when no log path was given (or `busy_log` is off)."""
        if self._busy_path is None or not end > start:
            return
        offset = time.time() - self.clock()
        row = {
            "role": role,
            "device": device,
            "start": start + offset,
            "end": end + offset,
            "devices": devices,
        }
        self._busy_path.parent.mkdir(parents=True, exist_ok=True)
        with self._busy_path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def load_busy_log(run_dir: Path) -> list[dict[str, float | str]]:
    """Every busy interval the paced workers of a run logged (<run_dir>/pacing/*.jsonl)."""
    rows: list[dict[str, float | str]] = []
    for path in sorted((Path(run_dir) / "pacing").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


def busy_device_s(rows: list[dict[str, float | str]], t0: float, t1: float) -> dict[str, float]:
    """Busy device-seconds per role inside [t0, t1] (unix seconds)."""
    out: dict[str, float] = {}
    for r in rows:
        a, b = max(float(r["start"]), t0), min(float(r["end"]), t1)
        if b > a:
            out[str(r["role"])] = out.get(str(r["role"]), 0.0) + (b - a) * float(r.get("devices", 1))
    return out


__all__ = [
    "DevicesConfig",
    "ModeledTurn",
    "Pacer",
    "PacingConfig",
    "Wait",
    "busy_device_s",
    "load_busy_log",
]
