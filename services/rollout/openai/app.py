"""The FastAPI app of the OpenAI-compatible endpoint (one error map) and its uvicorn server."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gyre.errors import Conflict, GyreError, InvalidArgument, NotFound, PayloadTooLarge

from .anthropic_messages import anthropic_error
from .endpoint import OpenAIEndpoint
from .routes import control_routes, model_routes
from .schema import ApiError

_STATUS: list[tuple[type[GyreError], int]] = [
    (NotFound, 404), (PayloadTooLarge, 413), (InvalidArgument, 400), (Conflict, 409),
]  # fmt: skip


def is_anthropic(path: str) -> bool:
    """Whether a path is the Anthropic API's (`/v1/messages`, `/v1/messages/...`, also per execution)."""
    return path.endswith("/v1/messages") or "/v1/messages/" in path


def _error(request: Request, status: int, message: str, kind: str) -> JSONResponse:
    """OpenAI's error body; Anthropic's (`{"type": "error", "error": {...}}`) on `/v1/messages*`."""
    if is_anthropic(request.url.path):
        return JSONResponse(anthropic_error(status, message), status_code=status)
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


_HTTP_KINDS = {404: "not_found_error", 405: "invalid_request_error"}


def create_app(endpoint: OpenAIEndpoint) -> FastAPI:
    """The FastAPI app: model routes at `/` and under `/x/{exec_token}`, control routes, one error map."""
    app = FastAPI(title="Gyre rollout (OpenAI-compatible)", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.endpoint = endpoint
    app.include_router(model_routes)
    app.include_router(model_routes, prefix="/x/{exec_token}")
    app.include_router(control_routes)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        response = _error(request, exc.status, str(exc), exc.kind)
        if exc.status == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        return response

    @app.exception_handler(GyreError)
    async def _gyre_error(request: Request, exc: GyreError) -> JSONResponse:
        status = next((code for cls, code in _STATUS if isinstance(exc, cls)), 503)
        return _error(request, status, str(exc), type(exc).__name__)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(request, 400, f"invalid request: {exc.errors()[:3]}", "InvalidArgument")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Routing errors (404 no such route, 405 wrong method) in the API's own error shape."""
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else exc.detail
        response = _error(
            request, exc.status_code, str(message), _HTTP_KINDS.get(exc.status_code, "api_error")
        )
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        """A bug: 500 in the API's own shape (the traceback is logged by the server)."""
        return _error(request, 500, f"internal error: {type(exc).__name__}", "api_error")

    return app


async def serve(app: FastAPI, host: str, port: int) -> tuple[Any, int]:
    """Start uvicorn (and the endpoint's idle reaper) in this event loop; returns (server, bound port).

    Stop with `server.should_exit = True`, then await `server.gyre_task`.
    """
    import contextlib
    from collections.abc import Iterator

    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn without its own signal handling: the service lifecycle owns SIGTERM/SIGINT.

        uvicorn's default swaps the process's handlers and re-raises the signal on exit, which the
        lifecycle then reads as a second signal and skips its drain grace periods.
        """

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    server = _Server(
        uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="off", timeout_graceful_shutdown=2
        )
    )
    endpoint: OpenAIEndpoint = app.state.endpoint

    async def serve_and_reap() -> None:
        """uvicorn plus the idle-execution reaper; a reaper that fails stops the server and raises."""
        http = asyncio.create_task(server.serve(), name="openai-http-serve")
        reaper = asyncio.create_task(endpoint.reap_forever(), name="openai-idle-reaper")
        done, _ = await asyncio.wait({http, reaper}, return_when=asyncio.FIRST_COMPLETED)
        if reaper in done:
            server.should_exit = True
            await http
            reaper.result()
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
        http.result()

    task = asyncio.create_task(serve_and_reap(), name="openai-http")
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    server.gyre_task = task  # type: ignore[attr-defined]
    if not endpoint.public_url:
        reachable = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host  # a wildcard bind: loopback
        endpoint.public_url = f"http://{reachable}:{int(bound)}"
    return server, int(bound)
