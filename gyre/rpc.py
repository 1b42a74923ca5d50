"""gRPC plumbing shared by every service: server factory, health, the one error boundary, channels.

* ``create_server(port=0)`` binds before returning, so tests get a free port back.
* ``add_health(server)`` registers grpc.health.v1; the service lifecycle sets its status
  (SERVING once ready, NOT_SERVING while draining), which compose and Kubernetes probes read.
* ``error_boundary`` is the only place where domain errors (gyre.errors) become gRPC status codes;
  each failure is counted and logged once there (a traceback only for unexpected errors).
* ``stop(server, health, grace_s)``: health goes NOT_SERVING, new calls are refused, calls in
  flight get `grace_s` seconds to finish, then are cancelled.
* Authentication: with a token (``create_server(token=...)``, else ``GYRE_GRPC_TOKEN``), every call
  must carry ``authorization: Bearer <token>`` or ends UNAUTHENTICATED before any servicer code
  runs. ``grpc.health.v1.Health`` stays open on purpose: compose and Kubernetes probes carry no
  secret, and a health answer tells nothing but SERVING / NOT_SERVING. ``channel()`` attaches the
  token (``token=...``, else the process default: ``set_default_token`` or ``GYRE_GRPC_TOKEN``).
  Without any token a server is open (tests, local development); ``gyre up`` always generates one.
"""

from __future__ import annotations

import functools
import hmac
import inspect
import logging
import os
import sys
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
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.PayloadTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
)

RPC_ERRORS = Counter(
    "gyre_rpc_errors_total", "gRPC calls that failed, by method and status code", ["method", "code"]
)

F = TypeVar("F", bound=Callable[..., Any])


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status of a domain error; UNAVAILABLE for a lost database connection (Postgres
    restarting: the caller retries); INTERNAL for anything else unexpected."""
    for cls, code in ERROR_CODES:
        if isinstance(exc, cls):
            return code
    sqlalchemy_exc = getattr(sys.modules.get("sqlalchemy"), "exc", None)  # only if the service uses it
    if sqlalchemy_exc is not None and isinstance(exc, sqlalchemy_exc.OperationalError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


# Environment variable holding the shared gRPC bearer token of a run (CommonConfig.grpc_token).
TOKEN_ENV = "GYRE_GRPC_TOKEN"
# Methods callable without the token: health checks (probes carry no secret).
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)
_default_token: str | None = None


def set_default_token(token: str | None) -> None:
    """The token ``create_server`` and ``channel`` use in this process when given none (the service
    lifecycle sets it from CommonConfig.grpc_token); None falls back to $GYRE_GRPC_TOKEN."""
    global _default_token
    _default_token = token or None


def default_token() -> str | None:
    """This process's gRPC token: set_default_token's, else $GYRE_GRPC_TOKEN, else None (open)."""
    return _default_token or os.environ.get(TOKEN_ENV) or None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call whose ``authorization`` metadata is not
    ``Bearer <token>``, except the methods of OPEN_METHOD_PREFIXES. Compared in constant time."""

    def __init__(self, token: str) -> None:
        if not token:
            raise errors.ConfigError("the gRPC token must not be empty; unset it to run without one")
        self._expected = f"Bearer {token}".encode()
        self.num_refused = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        given = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value if isinstance(value, str) else value.decode(errors="replace")
        if hmac.compare_digest(given.encode(), self._expected):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: UNIMPLEMENTED, as without the interceptor
        RPC_ERRORS.labels(method, grpc.StatusCode.UNAUTHENTICATED.name).inc()
        self.num_refused += 1
        if self.num_refused <= 5 or self.num_refused % 1000 == 0:  # a flood logs a few lines
            log.warning(
                "%s refused: %s bearer token (%d refused so far)",
                method,
                "wrong" if given else "no",
                self.num_refused,
            )
        return _refusing(handler, "missing or wrong bearer token" if given else "no bearer token")


def _refusing(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call UNAUTHENTICATED."""
    message = (
        f"{why}: this Gyre server requires `authorization: Bearer <token>` metadata "
        f"(the run's grpc_token / ${TOKEN_ENV}; gyre.rpc.channel attaches it)"
    )

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover (abort raises)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming, **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)


def create_server(
    host: str = "127.0.0.1", port: int = 0, *, token: str | None = None
) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server bound to host:port (0 = a free port); returns it with the bound port.
    With `token` (None: default_token(); "": open) every call but health checks needs it (module docstring).

    Register servicers, then ``await server.start()``."""
    token = token if token is not None else default_token()
    interceptors = [TokenAuthInterceptor(token)] if token else []
    server = grpc.aio.server(options=_OPTIONS, interceptors=interceptors)
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


def _with_token(details: grpc.aio.ClientCallDetails, value: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*tuple(details.metadata or ()))
    metadata.add("authorization", value)
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


# One interceptor class per call shape: grpc.aio files each interceptor under the first shape it
# matches, so one class implementing all four would only see unary-unary calls.
class _UnaryUnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._value), request)


class _UnaryStreamToken(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._value), request)


class _StreamUnaryToken(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(_with_token(client_call_details, self._value), request_iterator)


class _StreamStreamToken(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(_with_token(client_call_details, self._value), request_iterator)


def channel(address: str, *, token: str | None = None) -> grpc.aio.Channel:
    """An insecure grpc.aio channel to host:port with the same message limits as our servers, that
    sends `token` (None: default_token(); "": no token) as a bearer token on every call."""
    token = token if token is not None else default_token()
    value = f"Bearer {token}"
    interceptors: list[grpc.aio.ClientInterceptor] | None = (
        [
            _UnaryUnaryToken(value),
            _UnaryStreamToken(value),
            _StreamUnaryToken(value),
            _StreamStreamToken(value),
        ]
        if token
        else None
    )
    return grpc.aio.insecure_channel(address, options=_OPTIONS, interceptors=interceptors)


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
