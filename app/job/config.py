"""The `job:` section of a run YAML: how `gyre run` drives a training job and when it stops."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gyre.config import ConfigModel
from gyre.tracking import SinkName


class JobConfig(ConfigModel):
    """What `gyre run` does with a started deployment (the services read their own sections)."""

    num_steps: int = Field(
        20,
        ge=1,
        description="Trainer steps to run: the job stops once weight version `num_steps` is published.",
    )
    timeout_s: float = Field(
        900.0,
        gt=0,
        description="Wall-clock limit of the job in seconds, startup included; past it the job stops, "
        "writes the report of what happened and exits 1.",
    )
    group_size: int = Field(
        4, ge=1, description="Executions per task (a group: advantages are computed within it)."
    )
    live_groups: int = Field(
        4,
        ge=0,
        description="Groups the job keeps in flight: whenever fewer executions are live than "
        "live_groups * group_size, it starts new tasks (Rollout.StartExecutions). 0: start none (the "
        "rollout service or another client drives executions).",
    )
    poll_interval_s: float = Field(
        0.5, gt=0, description="Seconds between the job's looks at the rollout service's live executions."
    )
    stall_timeout_s: float = Field(
        300.0,
        ge=0,
        description="Watchdog (app/job/watchdog.py): when no weight version, stored call or scored group came "
        "for this long (s) and the trainer is not inside a step, the job asks every service what it waits on, "
        "writes it to <run_dir>/stall.json and ends with that reason (exit 1). 0: off.",
    )
    ingest_wait_s: float = Field(
        120.0,
        ge=0,
        description="After the last step the rollout service is stopped first; then the job waits up to this "
        "long (s) for the trajectory service to store every step published, before reading final counters.",
    )
    drain_s: float = Field(
        3.0,
        ge=0,
        description="Seconds to keep recording after the last step, so in-flight events reach the log before stop.",
    )
    tracking: list[SinkName] = Field(
        default_factory=list,
        description="Experiment trackers that get the run's metrics, several at once: any of tensorboard, "
        "wandb, mlflow, jsonl (each under <run_dir>/tracking/<name>/; packages of the `tracking` extra). "
        "Empty: none besides the run's own events.jsonl.",
    )
    tracking_project: str = Field(
        "gyre", min_length=1, description="W&B project and MLflow experiment name the run is logged under."
    )
    wandb_mode: Literal["offline", "online", "disabled"] = Field(
        "offline",
        description="W&B mode: offline writes the run to disk only (no network, no account; `wandb sync` "
        "uploads it later); online logs to the server WANDB_API_KEY / WANDB_BASE_URL name.",
    )
    ui_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve the dashboard (app/ui/) on 127.0.0.1 at this port while the job runs (0 = any "
        "free port); None: not served by the job (`gyre ui RUN_DIR` serves it during or after the run).",
    )
