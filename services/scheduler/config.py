"""Configuration of the scheduler service (the `scheduler:` section of a run YAML)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from gyre.config import ConfigModel


class SchedulerConfig(ConfigModel):
    """Device pool, leases and the policy that moves devices between rollout and training."""

    policy: Literal["colocate", "async", "elastic"] = Field(
        "elastic", description="Initial policy; SetPolicy changes it at run time (persisted)."
    )
    staleness_bound: int = Field(
        1, ge=0, description="Max (train step - policy version an execution started with); async and elastic."
    )
    async_rollout_devices: int | None = Field(
        None,
        ge=1,
        description=(
            "Devices the async policy keeps on rollout (fixed split; unset = half the pool; `gyre sim` sweeps "
            "it). For the elastic policy, a home split fixed by the operator (where it returns when no move "
            "pays); unset (the default, and what Elastic is measured with) = measured online from each "
            "role's busy device-seconds per step, half the pool until the first steps are measured."
        ),
    )
    num_logical_devices: int = Field(
        0,
        ge=0,
        description="Logical devices (CPU slots 'cpu0-0'...) the scheduler adds IDLE at start, for machines "
        "without accelerators; 0 = only devices that workers register.",
    )
    plan_interval_s: float = Field(1.0, gt=0, description="Seconds between two runs of the plan loop.")
    metrics_interval_s: float = Field(
        2.0,
        ge=0,
        description="Seconds between two pool MetricsEvents (devices leased per role, busy fractions, "
        "per-device busy; services/scheduler/pool_metrics.py), at most one per plan loop run; 0 = none.",
    )
    heartbeat_interval_s: float = Field(
        1.0, gt=0, description="Seconds between worker heartbeats (told to workers)."
    )
    worker_timeout_s: float = Field(
        10.0, gt=0, description="A worker silent this long (s) is declared dead; its devices are fenced."
    )
    drain_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Seconds a holder has to drain and Release after a REASSIGN; then rolled back.",
    )
    grant_timeout_s: float = Field(
        30.0, gt=0, description="Seconds a grantee has to Acquire after GRANTED; then the device goes IDLE."
    )
    role_change_s: float | None = Field(
        None,
        gt=0,
        description="Seconds one device needs to change role, as the elastic policy weighs a move. Unset: "
        "measured in this run as half a round trip (the mean of the median REASSIGN -> ACQUIRED time of "
        "the last 20 handoffs to training and of the last 20 back to rollout), a direction not yet timed "
        "counting 15 s.",
    )
    elastic_min_step_over_switch: float = Field(
        2.0,
        ge=0,
        description="Elastic lends rollout devices to a trainer that already holds devices only when its "
        "last step, or the training left in the step in progress, took more than this many role changes, "
        "and the training it has now outlasts as many; 0 = every such move pays (moves every step). "
        "2: a lent device goes and comes back, so a shorter step cannot repay the round trip. Swept 1-20 "
        "in the simulator on the shipped workloads: 1.5-2.5 best (docs/scheduler.md).",
    )
    default_engine_capacity: int = Field(
        4, ge=1, description="Executions one rollout device hosts, until a worker reports engine_capacity."
    )
    sim_workload: Path | None = Field(
        None,
        description="Workload YAML (docs/simulator.md) describing this deployment; `gyre compare` asks the "
        "simulator to predict it. Relative paths are relative to the run YAML.",
    )

    @model_validator(mode="after")
    def _check(self) -> SchedulerConfig:
        if self.worker_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"worker_timeout_s ({self.worker_timeout_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), or every worker is declared dead between two heartbeats"
            )
        return self
