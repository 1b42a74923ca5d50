"""Postgres access shared by the services: engine, transactional sessions, Alembic upgrades.

Each service owns its tables, its declarative ``Base`` and its Alembic directory
(``services/<name>/migrations``) with its own version table (``alembic_version_<name>``), so the
services share one database without sharing a migration history.

The engine is synchronous (psycopg 3); async code calls it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gyre.errors import ConfigError, Unavailable

log = logging.getLogger("gyre.store")

# script.py.mako that a service's migrations/ directory can copy.
MIGRATION_TEMPLATE = Path(__file__).with_name("script.py.mako")


def _normalise(url: str) -> str:
    if url.startswith(("postgresql://", "postgres://")):
        # Default to psycopg 3 (the driver we ship) instead of SQLAlchemy's psycopg2 default.
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def create_engine(url: str, *, pool_size: int = 5, max_overflow: int = 10, **kwargs: Any) -> sa.Engine:
    """A sync SQLAlchemy engine for Postgres (psycopg 3), checking connections before use."""
    try:
        return sa.create_engine(
            _normalise(url), pool_pre_ping=True, pool_size=pool_size, max_overflow=max_overflow, **kwargs
        )
    except sa.exc.ArgumentError as exc:
        raise ConfigError(
            f"database_url {url!r} is not a valid SQLAlchemy URL ({exc}); "
            "use postgresql+psycopg://user:password@host:5432/dbname"
        ) from None


def check_connection(engine: sa.Engine) -> None:
    """Raise Unavailable unless the database answers `SELECT 1`."""
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.OperationalError as exc:
        raise Unavailable(
            f"cannot reach Postgres at {engine.url.render_as_string(hide_password=True)}: {exc.orig}"
        ) from exc


@contextmanager
def session_scope(engine: sa.Engine) -> Iterator[Session]:
    """A session that commits when the block ends normally and rolls back if it raises."""
    with Session(engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def upgrade(url: str, migrations_dir: Path, version_table: str, revision: str = "head") -> None:
    """Apply the Alembic migrations in `migrations_dir` up to `revision`, recording them in
    `version_table`. Safe to run concurrently: a Postgres advisory lock per version table
    serialises upgrades of the same service."""
    from alembic import command
    from alembic.config import Config

    migrations_dir = Path(migrations_dir)
    if not (migrations_dir / "env.py").is_file():
        raise ConfigError(
            f"{migrations_dir} has no env.py; see gyre/store/alembic_env.py for the 3-line env.py"
        )
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir))
    cfg.attributes["url"] = _normalise(url)
    cfg.attributes["version_table"] = version_table
    log.info("alembic upgrade %s -> %s (%s)", migrations_dir, revision, version_table)
    try:
        command.upgrade(cfg, revision)
    except sa.exc.OperationalError as exc:
        raise Unavailable(
            f"cannot migrate {version_table}: Postgres unreachable or refused: {exc.orig}"
        ) from exc


__all__ = ["MIGRATION_TEMPLATE", "check_connection", "create_engine", "session_scope", "upgrade"]
