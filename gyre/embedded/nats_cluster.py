"""A local JetStream cluster of N nats-server processes, for tests of server loss (issue 26).

``with EmbeddedNatsCluster(tmp / "nats", passwords=...) as c: Bus.connect(c.url, ...)``.

Guarantees:

* Every node is an EmbeddedNats (gyre.embedded.nats, same config writer, same process runner):
  its own data dir and JetStream store under ``data_dir/n<i>``, ``server_name`` ``n<i>``, a free
  client port on 127.0.0.1, the same max_payload and per-role ``authorization`` block, monitoring
  on a free port, and a ``cluster`` block (name `name`, a route port chosen at construction, routes
  to every other node). Routes need a password generated per cluster, so no outside process can
  join the cluster as a route and bypass the client permissions.
* `start` returns only once every node accepts clients and all of them report the same JetStream
  meta leader (/jsz of the monitoring endpoint); Unavailable otherwise, with every node stopped.
* `url` is the comma-separated list of the client URLs, the form Bus.connect takes for a cluster;
  a client fails over between them. A node keeps its client and route ports across `restart`, so
  that list stays valid.
* `kill(i)` SIGKILLs node i (no flush: a crash); `restart(i)` starts it again on its store and
  waits for a meta leader; `stop` stops every node (SIGTERM, then SIGKILL). Idempotent, and also
  run at interpreter exit (each node registers its own stop).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

from gyre.bus.auth import generate_password
from gyre.embedded.nats import EmbeddedNats
from gyre.embedded.server import free_port
from gyre.errors import InvalidArgument, Unavailable

_ROUTE_USER = "route"


class _ClusterNode(EmbeddedNats):
    """An EmbeddedNats with a server name and a cluster block (routes to its peers)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        server_name: str,
        cluster_name: str,
        route_port: int,
        peer_route_ports: list[int],
        route_password: str,
        passwords: Mapping[str, str] | None,
        host: str,
    ) -> None:
        super().__init__(data_dir, host=host, monitoring=True, passwords=passwords)
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.route_port = route_port
        self.peer_route_ports = peer_route_ports
        self._route_password = route_password

    def _extra_config(self) -> list[str]:
        cred = f"{_ROUTE_USER}:{self._route_password}"
        routes = [f"nats-route://{cred}@{self.host}:{p}" for p in self.peer_route_ports]
        return [
            f"server_name: {json.dumps(self.server_name)}",
            "cluster {",
            f"  name: {json.dumps(self.cluster_name)}",
            f"  listen: {json.dumps(f'{self.host}:{self.route_port}')}",
            f"  authorization {{ user: {json.dumps(_ROUTE_USER)}, password: "
            f"{json.dumps(self._route_password)} }}",
            f"  routes: {json.dumps(routes)}",
            "}",
        ]

    def jsz(self, query: str = "") -> dict[str, object] | None:
        """The node's /jsz (JetStream) monitoring document (`query`: e.g. ``accounts=true&streams=true``
        for this node's own copy of every stream); None while it does not answer."""
        if self.monitoring_url is None or self.pid is None:
            return None
        try:
            url = self.monitoring_url + "/jsz" + (f"?{query}" if query else "")
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                data: dict[str, object] = json.loads(resp.read())
        except (OSError, ValueError):
            return None
        return data


class EmbeddedNatsCluster:
    """N (default 3) clustered nats-servers with JetStream on 127.0.0.1 (see the module docstring)."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        size: int = 3,
        name: str = "gyre",
        host: str = "127.0.0.1",
        passwords: Mapping[str, str] | None = None,
    ) -> None:
        if size < 1:
            raise InvalidArgument(f"a cluster needs at least one node, got size={size}")
        self.data_dir = Path(data_dir).resolve()
        self.name = name
        route_ports = [free_port(host) for _ in range(size)]
        route_password = generate_password()
        self.nodes: list[_ClusterNode] = [
            _ClusterNode(
                self.data_dir / f"n{i}",
                server_name=f"n{i}",
                cluster_name=name,
                route_port=route_ports[i],
                peer_route_ports=[p for j, p in enumerate(route_ports) if j != i],
                route_password=route_password,
                passwords=passwords,
                host=host,
            )
            for i in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        """Client URL (nats://host:port, no credentials) of every node, by index; kept across restarts."""
        out = []
        for node in self.nodes:
            if node.port is None:
                raise Unavailable("the cluster is not started")
            out.append(f"nats://{node.host}:{node.port}")
        return out

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what Bus.connect takes for a cluster)."""
        return ",".join(self.urls)

    def server_names(self) -> list[str]:
        """``server_name`` of every node, by index (stream info's ``cluster.leader`` is one of them)."""
        return [node.server_name for node in self.nodes]

    def index_of(self, server_name: str) -> int:
        """Index of the node named `server_name`; InvalidArgument for a name not in the cluster."""
        names = self.server_names()
        if server_name not in names:
            raise InvalidArgument(f"no node {server_name!r} in cluster {self.name} ({names})")
        return names.index(server_name)

    def start(self, timeout_s: float = 60.0) -> str:
        """Start every node and wait for a JetStream meta leader; returns `url`."""
        deadline = time.monotonic() + timeout_s
        try:
            for node in self.nodes:
                node.start(max(1.0, deadline - time.monotonic()))
            self.wait_for_meta_leader(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self.url

    def meta_leader(self) -> str | None:
        """The meta leader's server name when every running node reports the same one and it is
        one of them (after a kill the others name the dead leader until they elect anew), else None."""
        leaders = set()
        running = {node.server_name for node in self.nodes if node.pid is not None}
        for node in self.nodes:
            if node.server_name not in running:
                continue
            jsz = node.jsz()
            meta = jsz.get("meta_cluster") if jsz else None
            leaders.add(meta.get("leader") if isinstance(meta, dict) else None)
        if len(leaders) != 1:
            return None
        leader = leaders.pop()
        return leader if isinstance(leader, str) and leader in running else None

    def wait_for_meta_leader(self, timeout_s: float = 30.0) -> str:
        """Poll until the running nodes agree on a meta leader; returns its server name."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            leader = self.meta_leader()
            if leader is not None:
                return leader
            time.sleep(0.1)
        raise Unavailable(f"no JetStream meta leader in cluster {self.name} within {timeout_s} s")

    def stored_on(self, i: int, stream: str) -> int | None:
        """Messages node i's own copy of `stream` holds (its /jsz), None while it has none or is down."""
        jsz = self.nodes[i].jsz("accounts=true&streams=true")
        accounts = jsz.get("account_details") if jsz else None
        for account in accounts if isinstance(accounts, list) else []:
            for detail in account.get("stream_detail") or []:
                if detail.get("name") == stream:
                    return int(detail.get("state", {}).get("messages", 0))
        return None

    def kill(self, i: int) -> None:
        """SIGKILL node i (a crash: nothing flushed) and reap it; its store and ports stay."""
        node = self.nodes[i]
        pid = node.pid
        if pid is not None:
            os.killpg(pid, signal.SIGKILL)
        node.stop(timeout_s=5.0)

    def restart(self, i: int, timeout_s: float = 60.0) -> str:
        """Start node i again (same ports, same store) and wait for a meta leader; its client URL."""
        deadline = time.monotonic() + timeout_s
        url = self.nodes[i].restart(timeout_s)
        self.wait_for_meta_leader(max(1.0, deadline - time.monotonic()))
        return url

    def stop(self) -> None:
        """Stop every node (SIGTERM, SIGKILL after the grace period). Idempotent."""
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


__all__ = ["EmbeddedNatsCluster"]
