"""Who may call the OpenAI-compatible endpoint, and which execution each call belongs to.

Credentials (checked before a body is read): `Authorization: Bearer <key>`, or `x-api-key: <key>`
(what the Anthropic client sends; Bearer wins when both are present). The run's API key
(`rollout.openai.api_key`) may call the model routes; the admin key (`rollout.openai.admin_key`)
may call everything, and only it the admin routes. A per-execution key (issued by the server) may
call the model routes of its own execution only. No or wrong key -> 401; a key without the right
-> 403. With no API key configured the model routes are open. A per-execution base URL
`/x/{token}/v1` authenticates by its unguessable token alone.

The per-execution registry (`ExecutionRegistry`): the execution of the per-execution URL or key;
else the one named by header `X-Gyre-Execution-Id`, `metadata.execution_id` or `user`. A named
execution belongs to the key that opened it (another key naming it gets 403); a call naming none
gets 400 saying how to name one. An execution ends on `/end` or after `execution_idle_s` without
calls (published as TRUNCATED); later calls to it get 409.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fastapi import Request

from gyre.errors import Conflict, InvalidArgument, NotFound
from gyre.v1 import events_pb2

from ..agent import ExecutionSpec
from ..environments.base import Progress
from ..steps import StepSink
from .schema import ID_PATTERN, SamplingBody, forbidden, unauthorized

_NAMING_HELP = (
    "this call names no execution. Use the per-execution base URL and key that "
    "POST /gyre/executions returns (OPENAI_BASE_URL=<base_url>, OPENAI_API_KEY=<api_key>), or name "
    "it with the header X-Gyre-Execution-Id (or metadata.execution_id, or the `user` field); "
    "see docs/rollout.md"
)


@dataclass
class Caller:
    """Who made a request: `admin`, `run` (the run's API key) or `execution` (a per-execution key/URL)."""

    kind: Literal["admin", "run", "execution"]
    key_id: str  # a short fingerprint of the credential; owner tag of the executions it opens
    execution_id: str | None = None


@dataclass
class ExecutionState:
    """One open execution: its spec, the credential that owns it, calls so far, last call (monotonic s)."""

    spec: ExecutionSpec
    owner: str
    calls: int = 0
    last_call_s: float = field(default_factory=time.monotonic)


def _fingerprint(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()[:16]


class ExecutionRegistry:
    """Credentials and the open executions with their owners; publishes each execution's end.

    `api_key`: the run's key (None: model routes open). `admin_key`: the admin credential (None:
    admin routes refused). `execution_idle_s`: seconds without a call after which an execution is
    ended as TRUNCATED, checked every `reap_interval_s` seconds. `public_url`: this server's base
    URL (`http://host:port`, set by `serve`), used in issued per-execution base URLs.
    """

    def __init__(
        self,
        sink: StepSink,
        *,
        run_id: str,
        seed: int = 0,
        api_key: str | None = None,
        admin_key: str | None = None,
        execution_idle_s: float = 3600.0,
        reap_interval_s: float = 5.0,
        public_url: str = "",
    ) -> None:
        self.sink, self.run_id, self.seed = sink, run_id, seed
        self.api_key, self.admin_key = api_key, admin_key
        self.execution_idle_s, self.reap_interval_s = execution_idle_s, reap_interval_s
        self.public_url = public_url
        self.executions: dict[str, ExecutionState] = {}
        self._tokens: dict[str, str] = {}  # per-execution token -> execution id
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._last_reap_s = time.monotonic()

    def execution_of_token(self, token: str) -> str | None:
        """The open execution a per-execution token belongs to, if any."""
        return self._tokens.get(token)

    # -- credentials ---------------------------------------------------------------------------
    def authenticate(self, request: Request) -> Caller:
        """The caller of `request`, from its per-execution URL token or its Bearer (or x-api-key) key; else 401."""
        token = request.path_params.get("exec_token")
        if token is not None:
            execution_id = self._tokens.get(token)
            if execution_id is None:
                raise unauthorized("unknown or ended per-execution URL")
            return Caller("execution", f"x:{execution_id}", execution_id)
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header[:7].lower() == "bearer " else ""
        key = key or request.headers.get("x-api-key", "").strip()
        if key:
            if self.admin_key is not None and hmac.compare_digest(key.encode(), self.admin_key.encode()):
                return Caller("admin", "admin")
            if self.api_key is not None and hmac.compare_digest(key.encode(), self.api_key.encode()):
                return Caller("run", _fingerprint(key))
            execution_id = self._tokens.get(key)
            if execution_id is not None:
                return Caller("execution", f"x:{execution_id}", execution_id)
        if self.api_key is None:
            return Caller("run", "open")
        if not key:
            raise unauthorized(
                "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>' (rollout.openai.api_key)"
            )
        raise unauthorized("invalid API key")

    def require_admin(self, caller: Caller) -> None:
        if caller.kind != "admin":
            hint = "" if self.admin_key is not None else " (none is configured: rollout.openai.admin_key)"
            raise forbidden("this route needs the admin key" + hint)

    # -- executions ----------------------------------------------------------------------------
    def issue(
        self, *, task_id: str = "openai", group_id: str | None = None, execution_id: str | None = None
    ) -> tuple[str, str]:
        """Open an execution owned by a fresh secret token; returns (execution_id, token)."""
        execution_id = execution_id or f"{task_id}-{secrets.token_hex(6)}"
        for what, value in (
            ("execution id", execution_id),
            ("task id", task_id),
            ("group id", group_id or "g"),
        ):
            if not ID_PATTERN.match(value):
                raise InvalidArgument(f"{what} {value!r} must be 1-128 characters of [A-Za-z0-9_-]")
        if execution_id in self.executions or execution_id in self._ended:
            raise Conflict(f"execution {execution_id!r} already exists")
        token = secrets.token_urlsafe(24)
        spec = ExecutionSpec(
            self.run_id, task_id, group_id or f"{task_id}-g0", execution_id, "openai", seed=self.seed
        )
        self.executions[execution_id] = ExecutionState(spec, owner=f"x:{execution_id}")
        self._tokens[token] = execution_id
        return execution_id, token

    async def execution(self, request: Request, caller: Caller, body: SamplingBody) -> ExecutionState:
        """The execution this call belongs to (see the module docstring), opened if new."""
        await self.reap_idle()
        meta = body.metadata or {}
        named = request.headers.get("x-gyre-execution-id") or meta.get("execution_id") or body.user
        if caller.execution_id is not None:
            if named and named != caller.execution_id and request.headers.get("x-gyre-execution-id"):
                raise forbidden(f"this key belongs to execution {caller.execution_id!r}, not {named!r}")
            named = caller.execution_id
        if not named:
            raise InvalidArgument(_NAMING_HELP)
        task_id = request.headers.get("x-gyre-task-id") or meta.get("task_id") or "openai"
        for what, value in (("execution id", named), ("task id", task_id)):
            if not ID_PATTERN.match(value):
                raise InvalidArgument(f"{what} {value[:200]!r} must be 1-128 characters of [A-Za-z0-9_-]")
        if named in self._ended:
            raise Conflict(f"execution {named!r} has ended; open a new one")
        state = self.executions.get(named)
        if state is None:
            group = request.headers.get("x-gyre-group-id") or meta.get("group_id") or f"{task_id}-g0"
            if not ID_PATTERN.match(group):
                raise InvalidArgument(f"group id {group[:200]!r} must be 1-128 characters of [A-Za-z0-9_-]")
            spec = ExecutionSpec(self.run_id, task_id, group, named, "openai", seed=self.seed)
            state = self.executions[named] = ExecutionState(spec, owner=caller.key_id)
        elif state.owner != caller.key_id and caller.kind != "admin":
            raise forbidden(f"execution {named!r} belongs to another client")
        return state

    async def end(
        self,
        execution_id: str,
        kind: str,
        *,
        reward: float | None = None,
        error: str = "",
        progress: Progress | None = None,
    ) -> int:
        """End an execution: publish its ExecutionEvent and refuse later calls. Returns its call count.

        `progress` (partial progress for a truncated or failed execution) is set by the external harness.
        """
        state = self.executions.pop(execution_id, None)
        if state is None:
            raise NotFound(f"no open execution {execution_id!r} made calls through this endpoint")
        self._ended[execution_id] = None
        while len(self._ended) > 100_000:
            self._ended.popitem(last=False)
        for token in [t for t, e in self._tokens.items() if e == execution_id]:
            del self._tokens[token]
        kinds = {"finished": events_pb2.ExecutionEvent.KIND_FINISHED, "truncated": events_pb2.ExecutionEvent.KIND_TRUNCATED,
                 "failed": events_pb2.ExecutionEvent.KIND_FAILED}  # fmt: skip
        spec = state.spec
        ev = events_pb2.ExecutionEvent(
            event_id=f"{execution_id}.end", run_id=spec.run_id, task_id=spec.task_id, group_id=spec.group_id,
            execution_id=execution_id, kind=kinds[kind], num_calls=state.calls, environment="openai",
            error=error, created_unix_s=time.time(),
        )  # fmt: skip
        if reward is not None:
            ev.reward = reward
        if progress is not None:
            ev.progress.CopyFrom(progress.to_proto())
        await self.sink.publish_execution(ev)
        return state.calls

    async def reap_idle(self) -> None:
        """End (as TRUNCATED) every execution idle for longer than `execution_idle_s` (checked each 1 s)."""
        now = time.monotonic()
        if now - self._last_reap_s < 1.0:
            return
        self._last_reap_s = now
        idle = [e for e, s in self.executions.items() if now - s.last_call_s > self.execution_idle_s]
        for execution_id in idle:
            await self.end(execution_id, "truncated", error=f"no call for {self.execution_idle_s:.0f} s")

    async def reap_forever(self) -> None:
        """Reap idle executions every `reap_interval_s`, also when no call arrives (runs beside uvicorn)."""
        while True:
            await asyncio.sleep(self.reap_interval_s)
            self._last_reap_s = 0.0
            await self.reap_idle()


def issue_execution_endpoint(
    endpoint: ExecutionRegistry,
    *,
    task_id: str = "openai",
    group_id: str | None = None,
    execution_id: str | None = None,
) -> tuple[str, str]:
    """Open one execution and return `(base_url, api_key)` for an unmodified OpenAI client.

    `base_url` is `<public_url>/x/<token>/v1` and `api_key` is the same secret token: either one
    alone puts every call of the client into this execution (task `task_id`, group `group_id`,
    default `<task_id>-g0`) and no other; both are refused once the execution ends. Give them to
    the agent as `OPENAI_BASE_URL` / `OPENAI_API_KEY`. The token is 24 random bytes (url-safe).
    """
    _, token = endpoint.issue(task_id=task_id, group_id=group_id, execution_id=execution_id)
    return f"{endpoint.public_url}/x/{token}/v1", token


def endpoint_keys(
    api_key: str | None, admin_key: str | None, key_dir: Path, *, require_api_key: bool = True
) -> tuple[str | None, str]:
    """The endpoint's (API key, admin key): the configured ones, else read from or generated into `key_dir`.

    Generated keys are 32 random bytes (url-safe), written to `key_dir/openai_api_key` and
    `key_dir/openai_admin_key` with mode 0600 and reused on restart, so clients keep working.
    `require_api_key=False` returns None for the API key (model routes open).
    """

    def load_or_create(name: str) -> str:
        path = key_dir / name
        if path.exists():
            return path.read_text().strip()
        key_dir.mkdir(parents=True, exist_ok=True)
        key = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        return key

    api = (api_key or load_or_create("openai_api_key")) if require_api_key else None
    return api, admin_key or load_or_create("openai_admin_key")
