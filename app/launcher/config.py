"""The `launcher:` section of a run YAML: which services `gyre up` starts and how patiently."""

from __future__ import annotations

from pydantic import Field, field_validator

from gyre.config import ConfigModel

# Start order: each service may call the ones before it while starting (rollout registers its
# devices with the scheduler, the trainer pulls batches from trajectory). Stop order is the reverse.
SERVICE_ORDER: tuple[str, ...] = ("scheduler", "trajectory", "trainer", "rollout")


class LauncherConfig(ConfigModel):
    """How `gyre up` / `gyre run` start and stop the services of a run on one machine."""

    services: list[str] = Field(
        default_factory=lambda: list(SERVICE_ORDER),
        description=(
            "Services to start, each as its own OS process (`python -m services.<name>`). Started in the "
            "fixed order scheduler, trajectory, trainer, rollout whatever the order here; stopped in reverse."
        ),
    )
    host: str = Field(
        "127.0.0.1",
        description="Interface every service binds its gRPC and /metrics servers to (0.0.0.0: all interfaces).",
    )
    start_timeout_s: float = Field(
        180.0,
        gt=0,
        description="Seconds one service may take from spawn to gRPC health SERVING before the start fails.",
    )
    stop_grace_s: float = Field(
        45.0,
        gt=0,
        description=(
            "Seconds a service gets after SIGTERM before its process group is SIGKILLed; keep it above the "
            "service's own drain timeout plus gRPC grace (30 s + 5 s by default)."
        ),
    )

    nats_cluster_size: int = Field(
        1,
        description=(
            "Embedded NATS only (no nats_url / GYRE_NATS_URL): 1 runs one nats-server; 3 or 5 run a local "
            "JetStream cluster of that many nats-servers (cluster routes with a generated password, the same "
            "per-service users) and declares every stream with that many replicas, so the bus survives the "
            "loss of one server (of two with 5). Services get the comma-separated list of the nodes' URLs."
        ),
    )

    restart: bool = Field(
        True,
        description=(
            "Supervise the services (and embedded NATS / Postgres): one that exits while the deployment "
            "runs is started again with the same command, port and environment (GYRE_INCARNATION counts "
            "the starts), after an exponential backoff, within the restart budget below. False: the first "
            "exit ends `gyre up` / the job."
        ),
    )
    max_restarts: int = Field(
        5,
        ge=0,
        description=(
            "Restart budget: restarts of one service allowed within `restart_window_s`; one more exit "
            "and the supervisor gives up on it (the job ends, reporting why)."
        ),
    )
    restart_window_s: float = Field(
        600.0, gt=0, description="Seconds over which `max_restarts` is counted (a sliding window)."
    )
    restart_backoff_s: float = Field(
        0.5,
        ge=0,
        description="Seconds before the first restart of a service; doubled for each further restart in the window.",
    )
    restart_backoff_max_s: float = Field(
        30.0, ge=0, description="Upper bound of the restart backoff, in seconds."
    )

    @field_validator("nats_cluster_size")
    @classmethod
    def _raft_sized(cls, value: int) -> int:
        if value not in (1, 3, 5):
            raise ValueError(
                f"nats_cluster_size must be 1, 3 or 5 (a JetStream cluster needs an odd majority and stores "
                f"a stream on at most 5 servers), got {value}"
            )
        return value

    @field_validator("services")
    @classmethod
    def _known_and_unique(cls, value: list[str]) -> list[str]:
        unknown = [s for s in value if s not in SERVICE_ORDER]
        if unknown:
            raise ValueError(f"unknown service(s) {unknown}; choose from {list(SERVICE_ORDER)}")
        if not value:
            raise ValueError(f"name at least one service of {list(SERVICE_ORDER)}")
        return [s for s in SERVICE_ORDER if s in value]


def service_config_model(name: str) -> type[ConfigModel] | None:
    """The typed config model of service `name` (None for a name that is not a service). The
    application imports each service's config module directly, so the layer contract sees every
    edge; the config modules import only the runtime, so this pulls in no service code."""
    from services.rollout.config import RolloutConfig
    from services.scheduler.config import SchedulerConfig
    from services.trainer.config import TrainerConfig
    from services.trajectory.config import TrajectoryConfig

    models: dict[str, type[ConfigModel]] = {
        "scheduler": SchedulerConfig,
        "rollout": RolloutConfig,
        "trajectory": TrajectoryConfig,
        "trainer": TrainerConfig,
    }
    return models.get(name)


def address_overrides(name: str, started: dict[str, str]) -> dict[str, str]:
    """Env overrides that point service `name` at the services already started: for every field
    `<other>_address` of its config with `<other>` in `started`, GYRE_<NAME>__<OTHER>_ADDRESS=host:port
    (only fields that exist: an unknown key would fail the service's config)."""
    model = service_config_model(name)
    fields = set(model.model_fields) if model is not None else set()
    return {
        f"GYRE_{name.upper()}__{other.upper()}_ADDRESS": address
        for other, address in started.items()
        if f"{other}_address" in fields
    }
