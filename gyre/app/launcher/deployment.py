"""`Deployment`: a whole Gyre deployment on one machine, as a context manager.

    with Deployment("examples/quickstart.yaml") as d:
        print(d.endpoints.services["trainer"].grpc_address)

Start (each step waits for the previous one):

1. NATS and Postgres: the URLs given here, else the run config / GYRE_NATS_URL / GYRE_DATABASE_URL,
   else embedded servers under `<run_dir>/nats` and `<run_dir>/postgres` on free ports;
2. the JetStream streams (gyre.bus.subjects) and every service's migrations (gyre.store), once,
   before any service runs;
3. each service as its own process group, in the order scheduler, trajectory, trainer, rollout:
   spawn `python -m services.<name> --config FILE --port 0`, wait for its `GYRE_READY` line, then
   for gRPC health SERVING. Children get GYRE_NATS_URL, GYRE_DATABASE_URL, GYRE_RUN_ID,
   GYRE_RUN_DIR and, for every service started before them, GYRE_<NAME>_ADDRESS plus the override
   of their own config field `<name>_address` if they have one and neither the config nor the
   environment sets it (GYRE_TRAINER__TRAJECTORY_ADDRESS);
4. `<run_dir>/endpoints.json`.

A service that exits or times out during start raises DeploymentError with the tail of its log,
after everything started so far has been stopped. Stop runs in reverse order (SIGTERM, grace,
SIGKILL per process group), then the embedded servers; it always runs to the end, and no process
started here outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import psutil

from gyre.app.launcher.config import LauncherConfig, address_overrides
from gyre.app.launcher.endpoints import FILENAME, Endpoints, ServiceEndpoint
from gyre.app.launcher.healthcheck import check
from gyre.app.launcher.process import ServiceProcess
from gyre.config import CommonConfig, load_common, load_section, load_yaml
from gyre.errors import GyreError


class DeploymentError(GyreError):
    """A service could not be started or died; the message holds the tail of its log."""

    def __init__(self, message: str, service: str | None = None, log_tail: str = "") -> None:
        super().__init__(
            message + (f"\n--- last lines of {service}'s log ---\n{log_tail}" if log_tail else "")
        )
        self.service = service
        self.log_tail = log_tail


def address_env_var(service: str) -> str:
    """Environment variable holding a service's gRPC host:port, e.g. GYRE_SCHEDULER_ADDRESS."""
    return f"GYRE_{service.upper()}_ADDRESS"


class Deployment:
    """Embedded or external NATS + Postgres and every service process of one run.

    Arguments override the run config: `services` (names, any order), `nats_url`/`database_url`
    (external servers), `run_dir`, `extra_env` (added to every service's environment),
    `service_args` (extra command-line arguments per service), `on_progress` (called with one
    human-readable line per start/stop step).
    """

    def __init__(
        self,
        config_path: str | Path | None = None,
        *,
        services: Sequence[str] | None = None,
        run_dir: str | Path | None = None,
        nats_url: str | None = None,
        database_url: str | None = None,
        extra_env: Mapping[str, str] | None = None,
        service_args: Mapping[str, Sequence[str]] | None = None,
        start_timeout_s: float | None = None,
        stop_grace_s: float | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        self.config_path = Path(config_path).resolve() if config_path is not None else None
        self._raw = load_yaml(self.config_path)
        common = load_common(data=self._raw)
        overrides: dict[str, Any] = {}
        if services is not None:
            overrides["services"] = list(services)
        if start_timeout_s is not None:
            overrides["start_timeout_s"] = start_timeout_s
        if stop_grace_s is not None:
            overrides["stop_grace_s"] = stop_grace_s
        launcher = load_section(LauncherConfig, "launcher", data=self._raw)
        self.launcher = LauncherConfig.model_validate({**launcher.model_dump(), **overrides})
        self.common: CommonConfig = common
        self.run_dir = Path(run_dir if run_dir is not None else common.run_dir).resolve()
        self._nats_url = nats_url or common.nats_url
        self._database_url = database_url or common.database_url
        self._extra_env = dict(extra_env or {})
        self._service_args = {k: list(v) for k, v in (service_args or {}).items()}
        self._progress = on_progress or (lambda line: None)
        self._embedded: list[Any] = []  # EmbeddedNats / EmbeddedPostgres we started, in start order
        self._procs: list[ServiceProcess] = []
        self._endpoints: Endpoints | None = None
        self._stop_lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def endpoints(self) -> Endpoints:
        """Where everything is; only after start() returned."""
        if self._endpoints is None:
            raise RuntimeError("Deployment.endpoints is available once start() has returned")
        return self._endpoints

    @property
    def processes(self) -> list[ServiceProcess]:
        """The running service processes, in start order."""
        return list(self._procs)

    def start(self) -> Endpoints:
        """Start everything (see the module docstring); on any failure stop what started and raise."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Endpoints:
        self._refuse_second_launcher()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        nats_url = self._nats_url or self._start_embedded_nats()
        database_url = self._database_url or self._start_embedded_postgres()
        self._progress(f"declaring streams on {nats_url}")
        _run_async(_ensure_streams(nats_url))
        self._progress("applying migrations")
        from gyre.store.cli import upgrade_all

        upgrade_all(database_url, tuple(self.launcher.services))
        env = {
            **os.environ,
            **self._extra_env,
            "GYRE_NATS_URL": nats_url,
            "GYRE_DATABASE_URL": database_url,
            "GYRE_RUN_ID": self.common.run_id,
            "GYRE_RUN_DIR": str(self.run_dir),
            "PYTHONUNBUFFERED": "1",
        }
        services: dict[str, ServiceEndpoint] = {}
        for name in self.launcher.services:
            started = {other: ep.grpc_address for other, ep in services.items()}
            section = self._raw.get(name)
            given: dict[str, Any] = section if isinstance(section, dict) else {}
            wiring = {
                key: value
                for key, value in address_overrides(name, started).items()
                if key not in env and not given.get(key.split("__", 1)[1].lower())
            }
            endpoint = self._start_service(name, {**env, **wiring})
            services[name] = endpoint
            env[address_env_var(name)] = endpoint.grpc_address
        self._endpoints = Endpoints(
            run_id=self.common.run_id,
            run_dir=str(self.run_dir),
            nats_url=nats_url,
            database_url=database_url,
            launcher_pid=os.getpid(),
            services=services,
            embedded=[type(e).__name__.removeprefix("Embedded").lower() for e in self._embedded],
        )
        self._endpoints.write(self.run_dir)
        return self._endpoints

    def _refuse_second_launcher(self) -> None:
        """Two deployments in one run_dir would share embedded data dirs and logs: refuse the second."""
        path = self.run_dir / FILENAME
        if not path.is_file():
            return
        with contextlib.suppress(GyreError):
            other = Endpoints.read(path).launcher_pid
            if other != os.getpid() and psutil.pid_exists(other):
                raise DeploymentError(
                    f"another deployment (launcher pid {other}) is running with run_dir {self.run_dir}; "
                    "stop it first (Ctrl-C, or kill that pid) or choose another run_dir"
                )
        path.unlink(missing_ok=True)  # left behind by a launcher that was killed

    def _start_embedded_nats(self) -> str:
        from gyre.embedded import EmbeddedNats

        self._progress("starting embedded nats-server")
        server = EmbeddedNats(self.run_dir / "nats")
        self._embedded.append(server)
        return server.start()

    def _start_embedded_postgres(self) -> str:
        from gyre.embedded import EmbeddedPostgres

        self._progress("starting embedded Postgres")
        server = EmbeddedPostgres(self.run_dir / "postgres", database="gyre")
        self._embedded.append(server)
        return server.start()

    def _command(self, name: str) -> list[str]:
        cmd = [sys.executable, "-m", f"services.{name}", "--host", self.launcher.host, "--port", "0"]
        if self.config_path is not None:
            cmd += ["--config", str(self.config_path)]
        return cmd + self._service_args.get(name, [])

    def _start_service(self, name: str, env: Mapping[str, str]) -> ServiceEndpoint:
        self._progress(f"starting {name}")
        proc = ServiceProcess(name, self._command(name), env, self.run_dir / "logs" / f"{name}.log")
        self._procs.append(proc)
        deadline = time.monotonic() + self.launcher.start_timeout_s
        ready = None
        status = ""
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise DeploymentError(
                    f"{name} exited with status {proc.returncode} while starting (log: {proc.log_path})",
                    name,
                    proc.log_tail(),
                )
            ready = ready or proc.ready()
            if ready is not None:
                host = _connect_host(self.launcher.host)
                status = check(f"{host}:{ready.grpc_port}", timeout_s=2.0)
                if status == "SERVING":
                    self._progress(f"{name} serving on {host}:{ready.grpc_port}")
                    return ServiceEndpoint(
                        name=name,
                        grpc_address=f"{host}:{ready.grpc_port}",
                        metrics_url=f"http://{host}:{ready.metrics_port}/metrics",
                        pid=proc.pid,
                        log_path=str(proc.log_path),
                    )
            time.sleep(0.1)
        what = "print GYRE_READY" if ready is None else f"report SERVING (last health: {status})"
        raise DeploymentError(
            f"{name} did not {what} within {self.launcher.start_timeout_s:.0f} s (log: {proc.log_path})",
            name,
            proc.log_tail(),
        )

    def dead_services(self) -> list[ServiceProcess]:
        """Services whose process has exited (they should run until stop())."""
        return [p for p in self._procs if p.returncode is not None]

    def check_alive(self) -> None:
        """DeploymentError naming the first service that died, with its log tail."""
        for proc in self.dead_services():
            raise DeploymentError(
                f"{proc.name} exited with status {proc.returncode} (log: {proc.log_path})",
                proc.name,
                proc.log_tail(),
            )

    def stop(self) -> None:
        """Stop services in reverse start order, then the embedded servers. Idempotent; never raises
        for a process that is already gone."""
        with self._stop_lock:
            # Pop only after a stop returned: an interrupted stop() is finished by the next call.
            while self._procs:
                proc = self._procs[-1]
                self._progress(f"stopping {proc.name}")
                proc.stop(self.launcher.stop_grace_s)
                self._procs.pop()
            while self._embedded:
                server = self._embedded[-1]
                self._progress(f"stopping embedded {type(server).__name__.removeprefix('Embedded')}")
                server.stop()
                self._embedded.pop()
            if self._endpoints is not None:
                path = self.run_dir / FILENAME
                if path.is_file() and Endpoints.read(path).launcher_pid == os.getpid():
                    path.unlink()


def _connect_host(bind_host: str) -> str:
    """Where a client on this machine reaches a server bound to `bind_host`."""
    return "127.0.0.1" if bind_host in {"0.0.0.0", ""} else "[::1]" if bind_host == "::" else bind_host


async def _ensure_streams(nats_url: str) -> None:
    from gyre.bus import Bus

    bus = await Bus.connect(nats_url, name="launcher")
    try:
        await bus.ensure_streams()
    finally:
        await bus.close()


def _run_async(coro: Any) -> Any:
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
