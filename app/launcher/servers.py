"""The embedded NATS and Postgres of a deployment: which to start, what each is called, how to declare
the streams, and the small sync helpers the launcher shares.

Names (what `Deployment.embedded(kind)`, endpoints.json's ``embedded`` and the supervisor's restart
records use):

* ``nats``: one EmbeddedNats, or an EmbeddedNatsCluster (`launcher.nats_cluster_size` 3 or 5) as a
  whole; a cluster's nodes are supervised one by one as ``nats-n0``, ``nats-n1``, ... (a node that
  dies is started again on its ports and its store while the others serve);
* ``postgres``: the EmbeddedPostgres.

Streams are declared by the run's ``admin`` user once, before any service starts, with as many
replicas as the cluster has nodes (a single server: the count an existing stream has, 1 for a new
one); every service's own `ensure_streams()` keeps that count.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gyre.embedded import EmbeddedNats
from gyre.embedded.nats_cluster import EmbeddedNatsCluster

STARTS_NAME = "service_starts.json"  # in the run_dir: service -> processes started (read_starts)


def new_embedded_nats(
    data_dir: Path, *, passwords: Mapping[str, str], cluster_size: int
) -> EmbeddedNats | EmbeddedNatsCluster:
    """One nats-server (`cluster_size` 1) or a local JetStream cluster of `cluster_size` nodes under
    `data_dir` (node i in ``data_dir/n<i>``), with one user per role of `passwords`; not started."""
    if cluster_size > 1:
        return EmbeddedNatsCluster(data_dir, size=cluster_size, passwords=passwords)
    return EmbeddedNats(data_dir, passwords=passwords)


def kind_of(server: Any) -> str:
    """``nats`` or ``postgres`` for an embedded server (a NATS cluster is ``nats`` as a whole)."""
    if isinstance(server, EmbeddedNatsCluster):
        return "nats"
    return type(server).__name__.removeprefix("Embedded").lower()


def supervised_members(server: Any) -> list[tuple[str, Any]]:
    """(restart name, process) of what the supervisor watches in `server`: a cluster's every node as
    ``nats-n<i>``, else the server itself under its kind. Each process has `pid` (None once it exited)
    and `restart()` (same ports, same data)."""
    if isinstance(server, EmbeddedNatsCluster):
        return [(f"nats-{node.server_name}", node) for node in server.nodes]
    return [(kind_of(server), server)]


def stream_replicas(server: Any) -> int | None:
    """Replicas to declare the streams with: the cluster's size, else None (keep an existing count)."""
    return len(server.nodes) if isinstance(server, EmbeddedNatsCluster) else None


def read_starts(run_dir: Path) -> dict[str, int]:
    """Service -> processes started so far in `run_dir` (<run_dir>/STARTS_NAME; {} for a new run)."""
    try:
        data = json.loads((run_dir / STARTS_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): int(v) for k, v in data.items()} if isinstance(data, dict) else {}


def write_starts(run_dir: Path, starts: Mapping[str, int]) -> None:
    """Record the start counts (written whole to a temporary file, then renamed: never torn)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{STARTS_NAME}.tmp"
    tmp.write_text(json.dumps(dict(starts), sort_keys=True) + "\n")
    tmp.replace(run_dir / STARTS_NAME)


async def ensure_streams(nats_url: str, replicas: int | None) -> None:
    """Declare every stream of gyre.bus.subjects on `nats_url` (the admin's login on a secured
    server) with `replicas` (None: 1 for a new stream, an existing one keeps its count)."""
    from gyre.bus import Bus

    bus = await Bus.connect(nats_url, name="launcher")
    try:
        await bus.ensure_streams(replicas=replicas)
    finally:
        await bus.close()


def run_async(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, also when the caller's thread has a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coro))
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="gyre-launcher-async")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


__all__ = [
    "STARTS_NAME",
    "ensure_streams",
    "kind_of",
    "new_embedded_nats",
    "read_starts",
    "run_async",
    "stream_replicas",
    "supervised_members",
    "write_starts",
]
