"""The secrets `gyre up` generates for one run, and how each service receives its own.

``RunCredentials.load_or_create(run_dir)`` keeps them in ``<run_dir>/secrets/`` (directory 0700,
files 0600), so a restarted launcher or a restarted embedded server finds the same ones:

* ``credentials.json``: a NATS password per role of gyre.bus.auth (one per service, ``observer``
  for the job driver and analytics, ``admin`` for stream declarations), a Postgres password per
  service role (gyre.store.roles) and the run's gRPC bearer token;
* ``grpc_token``: the token alone, for ``export GYRE_GRPC_TOKEN=$(cat runs/<run>/secrets/grpc_token)``
  before calling a service's gRPC from another shell.

Each service process gets, in its environment, only what is its own: ``GYRE_NATS_URL`` with its
NATS user, ``GYRE_DATABASE_URL`` with its Postgres role, and the shared ``GYRE_GRPC_TOKEN``
(`service_env`). Nothing secret is printed or logged.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from gyre.bus import auth
from gyre.errors import ConfigError

SERVICES: tuple[str, ...] = auth.SERVICE_ROLES


def _token() -> str:
    # A prefix keeps the value a string when it is read back as YAML from an environment variable.
    return "gyre_" + secrets.token_urlsafe(32)


@dataclass
class RunCredentials:
    """Generated secrets of one run (module docstring)."""

    nats: dict[str, str]  # NATS role -> password
    postgres: dict[str, str]  # service -> password of its role gyre_<service>
    grpc_token: str

    @classmethod
    def generate(cls) -> RunCredentials:
        return cls(
            nats={role: _token() for role in auth.ROLES},
            postgres={service: _token() for service in SERVICES},
            grpc_token=_token(),
        )

    @classmethod
    def load_or_create(cls, run_dir: Path) -> RunCredentials:
        """The run's credentials from `<run_dir>/secrets/`, generated there on first use."""
        directory = Path(run_dir) / "secrets"
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.chmod(0o700)
        path = directory / "credentials.json"
        if path.is_file():
            try:
                creds = cls(**json.loads(path.read_text()))
            except (ValueError, TypeError) as exc:
                raise ConfigError(
                    f"{path} is not a valid credentials file ({exc}); delete it to regenerate"
                ) from None
            # Roles added since the file was written get a password now.
            fresh = cls.generate()
            missing = {r: p for r, p in fresh.nats.items() if r not in creds.nats}
            missing_pg = {s: p for s, p in fresh.postgres.items() if s not in creds.postgres}
            if not missing and not missing_pg:
                return creds
            creds.nats.update(missing)
            creds.postgres.update(missing_pg)
        else:
            creds = cls.generate()
        _write_private(path, json.dumps(asdict(creds), indent=2) + "\n")
        _write_private(directory / "grpc_token", creds.grpc_token + "\n")
        return creds

    def nats_url(self, base_url: str, role: str) -> str:
        """`base_url` with `role`'s NATS user and password; a comma-separated server list (a cluster)
        gets them in every URL."""
        return ",".join(
            auth.url_with_credentials(u.strip(), role, self.nats[role])
            for u in base_url.split(",")
            if u.strip()
        )


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600 from the first byte (atomically replaced)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
