"""endpoints.json: where a running deployment's servers and services can be reached.

`gyre up` (and every `Deployment`) writes `<run_dir>/endpoints.json` once all services are
healthy and removes it when it stops; `gyre status` and `gyre events` read it to find the
deployment without flags. Written atomically (temp file + rename): a reader sees the old file,
the new one or none, never half of one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gyre.errors import ConfigError

FILENAME = "endpoints.json"


@dataclass(frozen=True)
class ServiceEndpoint:
    """One running service process."""

    name: str
    grpc_address: str  # host:port of its gRPC server (health + the service's API)
    metrics_url: str  # Prometheus text endpoint, http://host:port/metrics
    pid: int  # process id; also its process group id (each service leads its own group)
    log_path: str  # stdout + stderr of the process


@dataclass(frozen=True)
class Endpoints:
    """Everything a client needs to reach one deployment."""

    run_id: str
    run_dir: str
    nats_url: str
    database_url: str
    launcher_pid: int
    services: dict[str, ServiceEndpoint] = field(default_factory=dict)
    embedded: list[str] = field(default_factory=list)  # "nats" / "postgres" when the launcher started them

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Endpoints:
        data: dict[str, Any] = json.loads(text)
        services = {name: ServiceEndpoint(**ep) for name, ep in data.pop("services", {}).items()}
        return cls(services=services, **data)

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / FILENAME
        tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: Path) -> Endpoints:
        """Parse an endpoints.json; ConfigError saying how to get one if it is missing or broken."""
        if path.is_dir():
            path = path / FILENAME
        if not path.is_file():
            raise ConfigError(
                f"{path} does not exist: no deployment is running with that run directory "
                "(start one with `gyre up`, or pass --address NAME=HOST:PORT)"
            )
        try:
            return cls.from_json(path.read_text())
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"{path} is not a valid endpoints file ({exc}); delete it and rerun `gyre up`"
            ) from exc
