"""Session fixtures: a real nats-server and a real Postgres on free ports, started once per test session.

* ``nats_url`` (str): JetStream-enabled nats-server (max_payload 8 MiB).
* ``postgres_url`` (str): SQLAlchemy URL of the server's default database.
* ``database_url`` (str, per test): a fresh, empty database on that server.
* ``run_dir`` (Path, per test): an empty directory to use as a run's ``run_dir``.

Set GYRE_TEST_NATS_URL / GYRE_TEST_DATABASE_URL to use external servers instead.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gyre.embedded import EmbeddedNats, EmbeddedPostgres

_db_counter = itertools.count()


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    external = os.environ.get("GYRE_TEST_NATS_URL")
    if external:
        yield external
        return
    with EmbeddedNats(tmp_path_factory.mktemp("nats")) as server:
        assert server.url is not None
        yield server.url


@pytest.fixture(scope="session")
def _postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres | str]:
    external = os.environ.get("GYRE_TEST_DATABASE_URL")
    if external:
        yield external
        return
    with EmbeddedPostgres(
        tmp_path_factory.mktemp("postgres"), database="gyre_test", durable=False, keep_data=False
    ) as server:
        yield server


@pytest.fixture(scope="session")
def postgres_url(_postgres_server: EmbeddedPostgres | str) -> str:
    if isinstance(_postgres_server, str):
        return _postgres_server
    assert _postgres_server.url is not None
    return _postgres_server.url


@pytest.fixture
def database_url(_postgres_server: EmbeddedPostgres | str) -> str:
    """A fresh empty database (name unique in the session) on the session's server."""
    name = f"t{next(_db_counter)}_{uuid.uuid4().hex[:8]}"
    if isinstance(_postgres_server, EmbeddedPostgres):
        return _postgres_server.create_database(name)
    import sqlalchemy as sa

    engine = sa.create_engine(_postgres_server, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    finally:
        engine.dispose()
    return engine.url.set(database=name).render_as_string(hide_password=False)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path


@pytest.fixture(scope="session", autouse=True)
def sandbox_users_can_reach_the_venv() -> None:
    """As root, sandboxed agents and the scorer run as uids of their own and must execute this venv's
    Python. A clone inside a directory closed to other users (e.g. a 0700 `mktemp -d`) would hide it:
    give its ancestors the search bit (o+x: enter, not list) as docs/rollout.md asks of a deployment."""
    if os.geteuid() != 0:
        return
    for parent in Path(__file__).resolve().parents:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            os.chmod(parent, mode | 0o001)
