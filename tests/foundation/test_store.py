"""gyre.store against a real Postgres (session fixture): engine, sessions, Alembic upgrades."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import sqlalchemy as sa

import gyre.store
from app import db as db_cli
from gyre.errors import ConfigError, Unavailable

ENV_PY = """
import sqlalchemy as sa
from gyre.store.alembic_env import run_env

metadata = sa.MetaData()
sa.Table("toy_items", metadata, sa.Column("id", sa.Integer, primary_key=True), sa.Column("name", sa.Text))
run_env(metadata)
"""

FIRST = """
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("toy_items", sa.Column("id", sa.Integer, primary_key=True), sa.Column("name", sa.Text))


def downgrade() -> None:
    op.drop_table("toy_items")
"""


@pytest.fixture
def migrations(tmp_path: Path) -> Path:
    root = tmp_path / "migrations"
    (root / "versions").mkdir(parents=True)
    (root / "env.py").write_text(textwrap.dedent(ENV_PY))
    (root / "script.py.mako").write_text(gyre.store.MIGRATION_TEMPLATE.read_text())
    (root / "versions" / "0001_toy.py").write_text(textwrap.dedent(FIRST))
    return root


def test_upgrade_creates_tables_and_its_own_version_table_and_is_idempotent(
    database_url: str, migrations: Path
) -> None:
    gyre.store.upgrade(database_url, migrations, "alembic_version_toy")
    gyre.store.upgrade(database_url, migrations, "alembic_version_toy")
    engine = gyre.store.create_engine(database_url)
    tables = set(sa.inspect(engine).get_table_names())
    with engine.connect() as conn:
        version = conn.execute(sa.text("SELECT version_num FROM alembic_version_toy")).scalar_one()
    engine.dispose()
    assert {"toy_items", "alembic_version_toy"} <= tables
    assert "alembic_version" not in tables
    assert version == "0001"


def test_session_scope_commits_on_success_and_rolls_back_on_error(
    database_url: str, migrations: Path
) -> None:
    gyre.store.upgrade(database_url, migrations, "alembic_version_toy")
    engine = gyre.store.create_engine(database_url)
    insert = sa.text("INSERT INTO toy_items (id, name) VALUES (:id, :name)")
    with gyre.store.session_scope(engine) as s:
        s.execute(insert, {"id": 1, "name": "kept"})
    with pytest.raises(RuntimeError), gyre.store.session_scope(engine) as s:
        s.execute(insert, {"id": 2, "name": "dropped"})
        raise RuntimeError("boom")
    with engine.connect() as conn:
        names = conn.execute(sa.text("SELECT name FROM toy_items ORDER BY id")).scalars().all()
    engine.dispose()
    assert names == ["kept"]


def test_unreachable_database_is_reported_as_unavailable() -> None:
    from gyre.embedded import free_port

    engine = gyre.store.create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nope")
    with pytest.raises(Unavailable, match="cannot reach Postgres"):
        gyre.store.check_connection(engine)


def test_a_malformed_database_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="postgresql\\+psycopg://"):
        gyre.store.create_engine("not a url")


def test_db_upgrade_command_without_a_database_says_how_to_set_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("GYRE_DATABASE_URL", raising=False)
    assert db_cli.main(["upgrade"]) == 2
    assert "GYRE_DATABASE_URL" in capsys.readouterr().err


def test_db_upgrade_command_upgrades_every_service_that_has_migrations(
    monkeypatch: pytest.MonkeyPatch, database_url: str
) -> None:
    monkeypatch.setenv("GYRE_DATABASE_URL", database_url)
    assert db_cli.main(["upgrade"]) == 0
    engine = gyre.store.create_engine(database_url)
    tables = set(sa.inspect(engine).get_table_names())
    engine.dispose()
    expected = {
        f"alembic_version_{name}" for name in db_cli.SERVICES if db_cli.migrations_dir(name) is not None
    }
    assert expected <= tables
