"""The one lifecycle of every Gyre service process: ready -> serving -> draining -> stopped.

``run_service`` (what ``python -m services.<name>`` calls) does, in order:

1. load the run config (CommonConfig + the ``<name>:`` section; env overrides) — a bad value
   exits 2 with a message saying how to fix it;
2. run the service's Alembic migrations (version table ``alembic_version_<name>``), open the
   Postgres engine, connect NATS and declare the streams;
3. build the service with ``factory(common, section)``, let ``Service.start(rt)`` register its gRPC
   servicers on ``rt.server`` and spawn its background tasks with ``rt.spawn``;
4. start gRPC and the Prometheus /metrics endpoint, set health SERVING and print
   ``GYRE_READY <name> <grpc_port> <metrics_port>`` on stdout (the launcher waits for that line);
5. on SIGTERM/SIGINT: health NOT_SERVING, ``Service.stop()`` drains (at most ``--drain-timeout``
   seconds), the gRPC server stops with a grace period, remaining tasks are cancelled, the bus is
   drained and closed, and the process exits 0. A second signal skips the grace periods.

A spawned task, a bus consumer, or a task handed to ``supervise`` (an engine loop a service
creates itself) that dies with an exception takes the service down the same way, but the exit
code is 1 and the error is logged: health turns NOT_SERVING at once, so a probe never sees a
zombie that says SERVING, and the supervisor (``gyre up``/``gyre run``, compose, Kubernetes)
restarts the process. A service never limps on without a loop.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import contextvars
import enum
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import grpc
import sqlalchemy
from grpc_health.v1._async import HealthServicer
from prometheus_client import Counter, Gauge

from gyre import rpc, store
from gyre.bus import Bus
from gyre.config import CommonConfig, ConfigModel, load_common, load_section
from gyre.errors import ConfigError, GyreError
from gyre.v1 import waits_pb2, waits_pb2_grpc
from gyre.waits import WaitsServicer

log = logging.getLogger("gyre.service")

ERRORS = Counter(
    "gyre_errors_total",
    "Errors handled at a service's boundary (RPC, event handler, background loop), by where and error type",
    ["service", "where", "error"],
)
STATE = Gauge("gyre_service_state", "Lifecycle state: 0 ready, 1 serving, 2 draining, 3 stopped", ["service"])


class State(enum.IntEnum):
    """Lifecycle of a service process; only moves forward."""

    READY = 0  # connected and migrated, service built, not serving yet
    SERVING = 1  # gRPC up, health SERVING
    DRAINING = 2  # signal or failure: health NOT_SERVING, Service.stop() running
    STOPPED = 3


# The Runtime of the service this process runs (set by _serve before Service.start): `supervise`
# finds it from any code of the service, e.g. an engine that creates its own loop task.
_CURRENT: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar("gyre_runtime", default=None)
_PROCESS_RUNTIME: list[Runtime] = []  # the same, for tasks whose context was copied before it was set


def current_runtime() -> Runtime | None:
    """The Runtime of the running service process, None outside `run_service` (in-process tests)."""
    return _CURRENT.get() or (_PROCESS_RUNTIME[-1] if _PROCESS_RUNTIME else None)


def supervise(task: asyncio.Task[Any], what: str) -> asyncio.Task[Any]:
    """Make `task` (a loop the service cannot run without) fatal: if it ends with an exception, the
    error is logged and counted and the running service goes NOT_SERVING and exits 1 (like a task
    of `Runtime.spawn`). A task that returns or is cancelled is not a failure. Outside a service
    process (a test driving an engine in-process) the failure is only logged. Returns `task`."""

    def _done(t: asyncio.Task[Any]) -> None:
        if t.cancelled() or t.exception() is None:
            return
        exc = t.exception()
        assert exc is not None
        rt = current_runtime()
        log.error("%s died%s", what, "; shutting the service down" if rt else "", exc_info=exc)
        if rt is not None:
            rt.count_error(f"task:{what}", exc)
            rt.fail(exc)

    task.add_done_callback(_done)
    return task


def count_error(service: str, where: str, exc: BaseException) -> None:
    """Count an error handled at a boundary (`where`: "rpc", "consumer:<durable>", a loop name...)."""
    ERRORS.labels(service, where, type(exc).__name__).inc()


class Service(abc.ABC):
    """One Gyre service. Implement start (register servicers, spawn loops) and stop (drain)."""

    name: ClassVar[str]

    @abc.abstractmethod
    async def start(self, rt: Runtime) -> None:
        """Register gRPC servicers on rt.server and start loops with rt.spawn; return promptly."""

    def waits(self) -> list[waits_pb2.Wait]:
        """What the service's loops wait on now (Waits.GetWaits, for the job's watchdog); computed
        from the service's state when asked. Default: nothing tracked."""
        return []

    async def stop(self) -> None:  # noqa: B027 (a service with nothing to drain keeps the default)
        """Drain: stop taking work, finish or hand off work in flight. Called before gRPC stops."""


@dataclass
class Runtime:
    """What a running service gets from the lifecycle: config, connections, its gRPC server."""

    common: CommonConfig
    bus: Bus
    engine: sqlalchemy.Engine
    server: grpc.aio.Server
    port: int
    name: str = ""
    health: HealthServicer | None = None
    metrics_port: int = 0
    state: State = State.READY
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set, repr=False)
    _failure: asyncio.Future[BaseException] | None = field(default=None, repr=False)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` as a background task; if it raises, the error is logged and counted and the
        service shuts down with exit code 1. Cancelled at shutdown after Service.stop()."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def count_error(self, where: str, exc: BaseException) -> None:
        """Count an error handled at this service's boundary (see gyre.service.count_error)."""
        count_error(self.name, where, exc)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        assert exc is not None
        log.error("task %r died; shutting the service down", task.get_name(), exc_info=exc)
        self.count_error(f"task:{task.get_name()}", exc)
        self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Shut the service down with exit code 1 because of `exc` (first failure wins). Health goes
        NOT_SERVING at once, before the drain starts, so no probe sees a dying service as SERVING."""
        if self._failure is not None and not self._failure.done():
            self._failure.set_result(exc)
            self.state = State.DRAINING
            STATE.labels(self.name).set(State.DRAINING)
            if self.health is not None:
                task = asyncio.get_running_loop().create_task(
                    rpc.set_serving(self.health, False, ("", self.name)), name="not-serving"
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)


def _parse_args(name: str, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m services.{name}", description=f"Run the Gyre {name} service."
    )
    parser.add_argument(
        "--config", type=Path, default=None, help=f"run YAML (common keys + a `{name}:` section)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address gRPC and /metrics listen on (0.0.0.0 in containers)"
    )
    parser.add_argument(
        "--port", type=int, default=0, help="gRPC port; 0 picks a free one (printed in GYRE_READY)"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus /metrics port; 0 picks a free one"
    )
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds Service.stop() may take")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds in-flight RPCs get after draining")
    return parser.parse_args(argv)


def run_service(
    name: str,
    config_cls: type[ConfigModel],
    factory: Callable[[CommonConfig, Any], Service],
    *,
    migrations_dir: Path | None,
    argv: list[str] | None = None,
) -> int:
    """Run service `name` until a signal or a failure; returns the process exit code
    (0 clean stop, 1 failure, 2 bad configuration)."""
    args = _parse_args(name, argv)
    try:
        common = load_common(args.config)
        section = load_section(config_cls, name, args.config)
    except ConfigError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    from gyre import logging as gyre_logging

    gyre_logging.setup(name, common.log_level)
    missing = [f for f in ("nats_url", "database_url") if getattr(common, f) is None]
    if missing:
        env = " and ".join(f"GYRE_{f.upper()}" for f in missing)
        print(
            f"{name}: set {env} (or {', '.join(missing)} in the config), or start it with `gyre up`",
            file=sys.stderr,
        )
        return 2
    try:
        return asyncio.run(_serve(name, common, section, factory, migrations_dir, args))
    except GyreError as exc:
        log.error("%s failed to start: %s", name, exc)
        return 1


async def _serve(
    name: str,
    common: CommonConfig,
    section: Any,
    factory: Callable[[CommonConfig, Any], Service],
    migrations_dir: Path | None,
    args: argparse.Namespace,
) -> int:
    assert common.nats_url is not None and common.database_url is not None
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    force = asyncio.Event()

    def _on_signal(sig: signal.Signals) -> None:
        if stop_requested.is_set():
            log.warning("second %s: skipping grace periods", sig.name)
            force.set()
        else:
            log.info("%s received: draining", sig.name)
            stop_requested.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig)

    if migrations_dir is not None:
        await asyncio.to_thread(store.upgrade, common.database_url, migrations_dir, f"alembic_version_{name}")
    engine = store.create_engine(common.database_url)
    await asyncio.to_thread(store.check_connection, engine)
    bus = await Bus.connect(common.nats_url, name=name)
    # The run's gRPC token guards this server and goes on every channel this process opens.
    rpc.set_default_token(common.grpc_token.get_secret_value() if common.grpc_token else None)
    server, port = rpc.create_server(args.host, args.port)
    health = rpc.add_health(server)
    metrics_httpd = None
    rt = Runtime(common=common, bus=bus, engine=engine, server=server, port=port, name=name, health=health)
    rt._failure = loop.create_future()
    bus.on_consumer_failure = rt.fail
    _CURRENT.set(rt)
    _PROCESS_RUNTIME.append(rt)
    service: Service | None = None
    exit_code = 0
    try:
        await bus.ensure_streams()
        from prometheus_client import start_http_server

        metrics_httpd, _ = start_http_server(args.metrics_port, addr=args.host)
        rt.metrics_port = int(metrics_httpd.server_port)
        STATE.labels(name).set(State.READY)
        service = factory(common, section)
        await service.start(rt)
        waits_pb2_grpc.add_WaitsServicer_to_server(WaitsServicer(name, service.waits), server)
        await server.start()
        await rpc.set_serving(health, True, ("", name))
        rt.state = State.SERVING
        STATE.labels(name).set(State.SERVING)
        # One write with its newline: print() writes the text and the newline separately, and a log
        # line from another thread landed between them once, so the launcher never saw the signal.
        sys.stdout.write(f"GYRE_READY {name} {port} {rt.metrics_port}\n")
        sys.stdout.flush()
        log.info("%s serving: grpc %s:%d, metrics %s:%d", name, args.host, port, args.host, rt.metrics_port)

        stop_wait = asyncio.create_task(stop_requested.wait())
        waiting: set[asyncio.Future[Any]] = {stop_wait, rt._failure}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if rt._failure.done():
            exit_code = 1
    except Exception as exc:
        log.exception("%s failed while starting", name)
        count_error(name, "start", exc)
        exit_code = 1
    finally:
        rt.state = State.DRAINING
        STATE.labels(name).set(State.DRAINING)
        await health.enter_graceful_shutdown()
        if service is not None:
            await _drain(service, args.drain_timeout, force)
        await server.stop(0 if force.is_set() else args.grace)
        for task in list(rt._tasks):
            task.cancel()
        await asyncio.gather(*rt._tasks, return_exceptions=True)
        try:
            await bus.close()
        except Exception as exc:  # a lost bus must not stop the exit: the code below still runs
            log.warning("closing the NATS connection failed: %r", exc)
        engine.dispose()
        if metrics_httpd is not None:
            metrics_httpd.shutdown()
            metrics_httpd.server_close()
        rt.state = State.STOPPED
        STATE.labels(name).set(State.STOPPED)
        _PROCESS_RUNTIME.remove(rt)
        if rt._failure is not None and rt._failure.done() and not rt._failure.cancelled():
            exit_code = 1
        log.info("%s stopped (exit %d)", name, exit_code)
    return exit_code


async def _drain(service: Service, timeout_s: float, force: asyncio.Event) -> None:
    drain = asyncio.create_task(service.stop())
    forced = asyncio.create_task(force.wait())
    done, _ = await asyncio.wait({drain, forced}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    forced.cancel()
    if drain not in done:
        log.warning("Service.stop() did not finish (timeout %.0f s or forced); cancelling it", timeout_s)
        drain.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await drain
    elif drain.exception() is not None:
        log.error("Service.stop() failed", exc_info=drain.exception())
