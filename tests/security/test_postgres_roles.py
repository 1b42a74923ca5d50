"""Postgres: a password on the superuser and one role per service that owns only its own tables.

A fresh embedded Postgres (not the session one): the real scheduler and trajectory migrations run as
their own roles, then each role is tried on the other's tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa

from app.db import upgrade_all
from gyre.embedded import EmbeddedPostgres
from gyre.store import roles

PASSWORDS = {"scheduler": "pw-sched", "trajectory": "pw-traj", "trainer": "pw-train", "rollout": "pw-roll"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    with EmbeddedPostgres(tmp_path_factory.mktemp("pg-roles"), durable=False, keep_data=False) as pg:
        yield pg


def _conninfo(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def test_the_superuser_needs_its_password(server: EmbeddedPostgres) -> None:
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(host="127.0.0.1", port=server.port, user="postgres", dbname="gyre").close()
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(
            host="127.0.0.1", port=server.port, user="postgres", password="guess", dbname="gyre"
        ).close()
    assert server.url is not None and server.password in server.url
    with psycopg.connect(_conninfo(server.url)) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)


def test_each_service_role_owns_its_tables_and_cannot_touch_the_others(server: EmbeddedPostgres) -> None:
    assert server.url is not None
    urls = roles.ensure_service_roles(server.url, PASSWORDS)
    assert roles.ensure_service_roles(server.url, PASSWORDS) == urls  # idempotent
    assert upgrade_all(server.url, ("scheduler", "trajectory"), urls=urls) == ["scheduler", "trajectory"]

    engine = sa.create_engine(server.url)
    with engine.connect() as conn:
        owners = dict(
            conn.execute(
                sa.text("SELECT tablename, tableowner FROM pg_tables WHERE schemaname = 'public'")
            ).all()
        )
    engine.dispose()
    assert owners["alembic_version_trajectory"] == "gyre_trajectory"
    assert owners["alembic_version_scheduler"] == "gyre_scheduler"
    trajectory_tables = [t for t, o in owners.items() if o == "gyre_trajectory"]
    scheduler_tables = [t for t, o in owners.items() if o == "gyre_scheduler"]
    assert len(trajectory_tables) > 1 and len(scheduler_tables) > 1
    assert set(owners.values()) == {"gyre_trajectory", "gyre_scheduler"}  # nothing owned by the superuser

    with psycopg.connect(_conninfo(urls["trajectory"])) as conn:
        conn.execute(f"SELECT count(*) FROM {trajectory_tables[0]}")  # its own: fine
    for service, foreign in (
        ("rollout", trajectory_tables[0]),
        ("trainer", scheduler_tables[0]),
        ("scheduler", trajectory_tables[0]),
        ("trajectory", scheduler_tables[0]),
    ):
        with psycopg.connect(_conninfo(urls[service]), autocommit=True) as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(f"SELECT * FROM {foreign}")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(f"DROP TABLE {foreign}")
    with psycopg.connect(_conninfo(urls["rollout"]), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("CREATE TABLE sneaky (x int)")  # a service without migrations creates nothing
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("CREATE ROLE thief LOGIN SUPERUSER")


def test_a_cluster_from_an_older_gyre_with_trust_gets_a_password(tmp_path: Path) -> None:
    data_dir = tmp_path / "pg"
    with EmbeddedPostgres(data_dir, durable=False) as pg:
        pgdata = pg.pgdata
    assert pgdata is not None
    hba = pgdata / "pg_hba.conf"
    hba.write_text(hba.read_text().replace("scram-sha-256", "trust"))  # as initdb --auth=trust wrote it
    with EmbeddedPostgres(data_dir, durable=False, keep_data=False) as pg:
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(host="127.0.0.1", port=pg.port, user="postgres", dbname="gyre").close()
        assert pg.url is not None
        with psycopg.connect(_conninfo(pg.url)) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
