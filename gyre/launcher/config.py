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

    @field_validator("services")
    @classmethod
    def _known_and_unique(cls, value: list[str]) -> list[str]:
        unknown = [s for s in value if s not in SERVICE_ORDER]
        if unknown:
            raise ValueError(f"unknown service(s) {unknown}; choose from {list(SERVICE_ORDER)}")
        if not value:
            raise ValueError(f"name at least one service of {list(SERVICE_ORDER)}")
        return [s for s in SERVICE_ORDER if s in value]
