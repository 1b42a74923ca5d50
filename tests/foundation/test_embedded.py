"""Embedded servers stop cleanly: no process of theirs is left once stop() returns."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
import pytest

from gyre.embedded import EmbeddedNats, EmbeddedPostgres


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


def test_embedded_nats_with_monitoring_stops_without_leaving_its_process(tmp_path: Path) -> None:
    with EmbeddedNats(tmp_path / "nats", monitoring=True) as server:
        pid = server.pid
        assert server.url is not None and server.url.startswith("nats://127.0.0.1:")
        assert server.monitoring_url is not None
    assert pid is not None and not _alive(pid)
    assert server.url is None


def test_embedded_postgres_keeps_data_across_restarts_and_leaves_no_process(tmp_path: Path) -> None:
    data_dir = tmp_path / "pg"
    with EmbeddedPostgres(data_dir, database="keep", durable=False) as server:
        assert server.port is not None
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(host="127.0.0.1", port=server.port, user="postgres", dbname="keep").close()
        with psycopg.connect(
            host="127.0.0.1", port=server.port, user="postgres", password=server.password, dbname="keep"
        ) as conn:
            conn.execute("CREATE TABLE kept (x int)")
            conn.execute("INSERT INTO kept VALUES (42)")
        pgdata = str(server.pgdata)
    assert _processes_mentioning(pgdata) == []
    with EmbeddedPostgres(data_dir, database="keep", durable=False, keep_data=False) as server:
        assert server.port is not None
        with psycopg.connect(server.url_of("keep").replace("+psycopg", "")) as conn:  # the password kept
            row = conn.execute("SELECT x FROM kept").fetchone()
    assert row == (42,)
    assert _processes_mentioning(pgdata) == []
