"""gRPC plumbing shared by every service: server factory, health, the one error boundary, channels.

* ``create_server(port=0)`` binds before returning, so tests get a free port back.
* ``add_health(server)`` registers grpc.health.v1; the service lifecycle sets its status
  (SERVING once ready, NOT_SERVING while draining), which compose and Kubernetes probes read.
* ``error_boundary`` is the only place where domain errors (gyre.errors) become gRPC status codes;
  each failure is counted and logged once there (a traceback only for unexpected errors).
* ``stop(server, health, grace_s)``: health goes NOT_SERVING, new calls are refused, calls in
  flight get `grace_s` seconds to finish, then are cancelled.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import Counter

from gyre import errors

log = logging.getLogger("gyre.rpc")

# Largest gRPC message either side sends or accepts (bytes): packed batches travel over gRPC.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# Domain error -> gRPC status code. Checked in order: the first matching class wins.
ERROR_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.StaleEpoch, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Conflict, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.PayloadTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
)

RPC_ERRORS = Counter(
    "gyre_rpc_errors_total", "gRPC calls that failed, by method and status code", ["method", "code"]
)

F = TypeVar("F", bound=Callable[..., Any])


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status of a domain error; INTERNAL for anything unexpected."""
    for cls, code in ERROR_CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def create_server(host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server bound to host:port (0 = a free port); returns it with the bound port.

    Register servicers, then ``await server.start()``."""
    server = grpc.aio.server(options=_OPTIONS)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise errors.Unavailable(f"cannot bind gRPC server to {host}:{port}; is the port in use?")
    return server, bound


def add_health(server: grpc.aio.Server) -> HealthServicer:
    """Register grpc.health.v1 on `server`; status starts NOT_SERVING until the service is ready."""
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    return health


async def set_serving(health: HealthServicer, serving: bool, services: tuple[str, ...] = ("",)) -> None:
    """Set the health of the server ("") and of the named services to SERVING or NOT_SERVING."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in services:
        await health.set(name, status)


async def stop(server: grpc.aio.Server, health: HealthServicer | None = None, grace_s: float = 10.0) -> None:
    """Graceful stop: health NOT_SERVING, refuse new calls, give calls in flight `grace_s` seconds."""
    if health is not None:
        await health.enter_graceful_shutdown()
    await server.stop(grace_s)


def channel(address: str) -> grpc.aio.Channel:
    """An insecure grpc.aio channel to host:port with the same message limits as our servers."""
    return grpc.aio.insecure_channel(address, options=_OPTIONS)


async def _fail(method: str, context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code = status_code_for(exc)
    RPC_ERRORS.labels(method, code.name).inc()
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed unexpectedly", method, exc_info=exc)
        message = f"internal error in {method}: {type(exc).__name__}: {exc}"
    else:
        log.warning("%s -> %s: %s", method, code.name, exc)
        message = str(exc)
    await context.abort(code, message)


def error_boundary(fn: F) -> F:
    """Decorate a servicer method (unary or streaming, request or response) so that a raised
    gyre.errors error becomes its gRPC status (see ERROR_CODES), anything else INTERNAL.

    The context must be the method's last positional argument, as grpc passes it. Aborts by the
    method itself and cancellations pass through untouched."""
    method = fn.__qualname__
    passthrough = (grpc.aio.AbortError,)

    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream_wrapper(*args: Any) -> AsyncIterator[Any]:
            try:
                async for item in fn(*args):
                    yield item
            except passthrough:
                raise
            except Exception as exc:
                await _fail(method, args[-1], exc)

        return cast(F, stream_wrapper)

    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"error_boundary needs an async servicer method, got {method}")

    @functools.wraps(fn)
    async def unary_wrapper(*args: Any) -> Any:
        try:
            return await fn(*args)
        except passthrough:
            raise
        except Exception as exc:
            await _fail(method, args[-1], exc)

    return cast(F, unary_wrapper)
