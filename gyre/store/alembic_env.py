"""The body of every service's Alembic ``env.py``.

A service's ``migrations/env.py`` is::

    from gyre.store.alembic_env import run_env
    from services.<name>.models import Base

    run_env(Base.metadata)

``gyre.store.upgrade`` passes the URL and the version table through ``config.attributes``; the
``alembic`` command line works too when ``sqlalchemy.url`` and ``version_table`` are set as main
options (or GYRE_DATABASE_URL is exported).
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from alembic import context


def _setting(name: str, env: str | None = None) -> str | None:
    config = context.config
    value = config.attributes.get(name) or config.get_main_option(name)
    if value is None and env is not None:
        value = os.environ.get(env)
    return value


def run_env(metadata: sa.MetaData) -> None:
    """Run the migrations of one service, offline (SQL script) or online (against the database)."""
    url = _setting("url") or _setting("sqlalchemy.url", "GYRE_DATABASE_URL")
    if not url:
        raise RuntimeError("no database URL: call gyre.store.upgrade(url, ...) or set GYRE_DATABASE_URL")
    version_table = _setting("version_table")
    if not version_table:
        raise RuntimeError("no version_table: each service records its migrations in alembic_version_<name>")
    options: dict[str, Any] = {
        "target_metadata": metadata,
        "version_table": version_table,
        "compare_type": True,
    }

    if context.is_offline_mode():
        context.configure(url=url, literal_binds=True, **options)
        with context.begin_transaction():
            context.run_migrations()
        return

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, **options)
            with context.begin_transaction():
                # One upgrader per service at a time (several replicas may start together).
                connection.execute(
                    sa.text("SELECT pg_advisory_xact_lock(hashtext(:t))"), {"t": version_table}
                )
                context.run_migrations()
    finally:
        engine.dispose()
