"""`gyre db upgrade [--config FILE] [--service NAME ...]`: apply every service's Alembic migrations.

Services keep their migrations in services/<name>/migrations (version table alembic_version_<name>);
a service without that directory yet is skipped with a note. The database comes from the run
config's `database_url` or GYRE_DATABASE_URL.

This is application code: it finds each service's package by an import statement (the layer
contract in pyproject.toml sees it), never by a module-name string.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import services.rollout
import services.scheduler
import services.trainer
import services.trajectory

# The service packages (their __init__ modules import nothing heavy), by service name.
SERVICE_PACKAGES: dict[str, ModuleType] = {
    "scheduler": services.scheduler,
    "rollout": services.rollout,
    "trajectory": services.trajectory,
    "trainer": services.trainer,
}
SERVICES = tuple(SERVICE_PACKAGES)


def migrations_dir(service: str) -> Path | None:
    """services/<service>/migrations if that service exists and has the directory (with env.py)."""
    package = SERVICE_PACKAGES.get(service)
    if package is None or package.__file__ is None:
        return None
    path = Path(package.__file__).parent / "migrations"
    return path if (path / "env.py").is_file() else None


def upgrade_all(
    url: str, services: tuple[str, ...] = SERVICES, *, urls: Mapping[str, str] | None = None
) -> list[str]:
    """Upgrade each named service to head; returns the services that had migrations. A service in
    `urls` is migrated with its own URL (its own role, which then owns its tables; gyre.store.roles)."""
    from gyre.store import upgrade

    done = []
    for name in services:
        path = migrations_dir(name)
        if path is None:
            print(
                f"gyre db upgrade: {name}: no migrations yet (services/{name}/migrations), skipped",
                file=sys.stderr,
            )
            continue
        upgrade((urls or {}).get(name, url), path, f"alembic_version_{name}")
        done.append(name)
    return done


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gyre db", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("upgrade", help="apply every service's migrations up to head")
    up.add_argument(
        "--config", type=Path, default=None, help="run YAML (database_url); env GYRE_DATABASE_URL wins"
    )
    up.add_argument("--service", action="append", choices=SERVICES, help="only this service (repeatable)")
    args = parser.parse_args(argv)

    from gyre.config import load_common
    from gyre.errors import GyreError

    try:
        common = load_common(args.config)
        if not common.database_url:
            print(
                "gyre db upgrade: no database: set database_url in the config or GYRE_DATABASE_URL "
                "(`gyre up` runs the migrations itself against its embedded Postgres)",
                file=sys.stderr,
            )
            return 2
        done = upgrade_all(common.database_url, tuple(args.service or SERVICES))
    except GyreError as exc:
        print(f"gyre db upgrade: {exc}", file=sys.stderr)
        return 1
    print(f"upgraded: {', '.join(done) if done else 'nothing (no service has migrations yet)'}")
    return 0
