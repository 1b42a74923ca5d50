"""`gyre ui RUN_DIR [--host 127.0.0.1] [--port 8265]`: serve the dashboard of one run directory.

Read-only: every route reads files of the run directory, none writes there (except the key file
below, once, when the run has none). Bound to 127.0.0.1 unless told otherwise. Behind the run's
key: the run's gRPC bearer token (`<run_dir>/secrets/grpc_token`, made by `gyre run`), or for a
directory without one a key generated into `<run_dir>/secrets/ui_key` (mode 0600). A browser
passes it once (the login form, or `?key=` in the address) and gets it back as an HttpOnly
cookie; scripts send `Authorization: Bearer <key>`. The key is never printed.

Live: a page is rendered from the files as they are when it is asked for (a read is cached until
events.jsonl or trees.jsonl changes), so the dashboard of a running job follows it.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
import secrets
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from app.job.eventlog import EVENT_LOG_NAME
from app.job.trees import trees_path
from app.ui import pages
from app.ui.data import RunView, read_run, read_trees

COOKIE = "gyre_ui_key"
DEFAULT_PORT = 8265
STATIC = Path(__file__).parent / "static"


def run_key(run_dir: Path) -> tuple[str, Path]:
    """The key that opens the dashboard of `run_dir`, and the file it is in (see the module doc)."""
    token = run_dir / "secrets" / "grpc_token"
    if token.is_file() and token.read_text().strip():
        return token.read_text().strip(), token
    path = run_dir / "secrets" / "ui_key"
    if not path.is_file():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write("gyre_" + secrets.token_urlsafe(32) + "\n")
    return path.read_text().strip(), path


class RunFiles:
    """The run's view and trees, re-read only when their file changed (thread-safe)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._lock = threading.Lock()
        self._view: tuple[tuple[float, int], RunView] | None = None
        self._trees: tuple[tuple[float, int], dict[str, dict[str, Any]]] | None = None

    @staticmethod
    def _stamp(path: Path) -> tuple[float, int]:
        try:
            st = path.stat()
        except FileNotFoundError:
            return (0.0, -1)
        return (st.st_mtime, st.st_size)

    def view(self) -> RunView:
        stamp = self._stamp(self.run_dir / EVENT_LOG_NAME)
        with self._lock:
            if self._view is None or self._view[0] != stamp:
                self._view = (stamp, read_run(self.run_dir))
            return self._view[1]

    def trees(self) -> dict[str, dict[str, Any]]:
        stamp = self._stamp(trees_path(self.run_dir))
        with self._lock:
            if self._trees is None or self._trees[0] != stamp:
                self._trees = (stamp, read_trees(self.run_dir))
            return self._trees[1]


def create_app(run_dir: Path, key: str, key_path: Path) -> Starlette:
    """The dashboard app of one run directory (no server started; tests and `serve` run it)."""
    files = RunFiles(run_dir)

    def authorised(request: Request) -> bool:
        given = request.cookies.get(COOKIE, "")
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            given = header[7:].strip()
        return bool(given) and hmac.compare_digest(given.encode(), key.encode())

    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        path = request.url.path
        if path.startswith("/static/") or path == "/login":
            return await call_next(request)
        given = request.query_params.get("key")
        if given is not None:
            if not hmac.compare_digest(given.encode(), key.encode()):
                return HTMLResponse(pages.login(key_path, failed=True), status_code=401)
            response: Response = RedirectResponse(path, status_code=303)
            response.set_cookie(COOKIE, key, httponly=True, samesite="strict")
            return response
        if not authorised(request):
            return HTMLResponse(pages.login(key_path, failed=False), status_code=401)
        return await call_next(request)

    def overview(request: Request) -> Response:
        return HTMLResponse(pages.overview(files.view()))

    def executions(request: Request) -> Response:
        return HTMLResponse(pages.executions(files.view()))

    def groups(request: Request) -> Response:
        return HTMLResponse(pages.groups(files.view(), files.trees()))

    def group(request: Request) -> Response:
        view = files.trees().get(request.path_params["group_id"])
        if view is None:
            return HTMLResponse("no such group in the tree export", status_code=404)
        node_id = request.query_params.get("node")
        selected = int(node_id) if node_id is not None and node_id.isdigit() else None
        return HTMLResponse(pages.tree_page(files.view(), view, selected=selected))

    def execution(request: Request) -> Response:
        eid = request.path_params["execution_id"]
        view = next(
            (
                g
                for g in files.trees().values()
                if any(e["execution_id"] == eid for e in g.get("executions", []))
            ),
            None,
        )
        if view is None:
            return HTMLResponse("no such execution in the tree export", status_code=404)
        return HTMLResponse(pages.tree_page(files.view(), view, execution_id=eid))

    def node(request: Request) -> Response:
        view = files.trees().get(request.path_params["group_id"])
        html = pages.node_fragment(view, int(request.path_params["node_id"])) if view is not None else None
        if html is None:
            return HTMLResponse("no such node", status_code=404)
        return HTMLResponse(html)

    async def login(request: Request) -> Response:
        if request.method == "POST":
            form = await request.form()
            given = str(form.get("token", ""))
            if given and hmac.compare_digest(given.encode(), key.encode()):
                response: Response = RedirectResponse("/", status_code=303)
                response.set_cookie(COOKIE, key, httponly=True, samesite="strict")
                return response
            return HTMLResponse(pages.login(key_path, failed=True), status_code=401)
        return HTMLResponse(pages.login(key_path, failed=False))

    app = Starlette(
        routes=[
            Route("/", overview),
            Route("/executions", executions),
            Route("/executions/{execution_id}", execution),
            Route("/groups", groups),
            Route("/groups/{group_id}", group),
            Route("/groups/{group_id}/nodes/{node_id:int}", node),
            Route("/login", login, methods=["GET", "POST"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]
    )
    app.add_middleware(BaseHTTPMiddleware, dispatch=guard)
    return app


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class DashboardServer:
    """uvicorn serving `create_app` in a background thread (`gyre run` while the job runs, tests)."""

    def __init__(self, run_dir: Path, host: str = "127.0.0.1", port: int = 0) -> None:
        import socket

        import uvicorn

        key, key_path = run_key(run_dir)
        self.key_path = key_path
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, int(self.sock.getsockname()[1])
        config = uvicorn.Config(create_app(run_dir, key, key_path), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def start(self) -> DashboardServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre ui", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="run directory (e.g. runs/quickstart)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 = any free)"
    )
    args = parser.parse_args(argv)
    run_dir = args.run_dir.resolve()
    if not run_dir.is_dir():
        print(f"error: {run_dir} is not a directory", file=sys.stderr)
        return 2
    if not _is_loopback(args.host):
        print(
            f"warning: serving on {args.host}: anyone who can reach it and has the key can read the run",
            file=sys.stderr,
        )
    ensure_trees(run_dir)
    server = DashboardServer(run_dir, args.host, args.port)
    print(f"gyre ui: {server.url}  (key: cat {server.key_path}); Ctrl-C stops", flush=True)
    server.thread.run()  # in this thread: Ctrl-C stops uvicorn
    return 0


def ensure_trees(run_dir: Path) -> Path | None:
    """The run's trees.jsonl; when a finished run has none (it ended before writing them), written
    now from the run's own database (services/trajectory/cli.py run_database: its stopped embedded
    Postgres started for the export and stopped after). None, said on stderr, when that fails."""
    path = trees_path(run_dir)
    if path.is_file() or not (run_dir / "config.yaml").is_file():
        return path if path.is_file() else None
    from app.job.trees import export_trees
    from gyre.errors import GyreError
    from services.trajectory.cli import run_database

    try:
        with run_database(run_dir) as (run_id, database_url):
            return export_trees(database_url, run_id, run_dir)
    except (GyreError, OSError, ValueError) as exc:
        print(f"warning: no trees for {run_dir} ({exc})", file=sys.stderr, flush=True)
        return None


def serve_for_job(run_dir: Path, port: int | None) -> DashboardServer | None:
    """What `gyre run` does for the dashboard: serve it on 127.0.0.1:`port` for as long as the job
    runs (port None: not served), and print where to open it either way."""
    if port is None:
        print(f"dashboard: gyre ui {run_dir}  (while the run goes on, or after it)", flush=True)
        return None
    server = DashboardServer(run_dir, "127.0.0.1", port).start()
    print(
        f"dashboard: {server.url}  (key: cat {server.key_path}; after the job: gyre ui {run_dir})", flush=True
    )
    return server
