"""OpenAI-compatible HTTP endpoint inside the rollout service (FastAPI, served by uvicorn).

So that an existing agent harness can be trained unchanged: point its OpenAI client at a base URL
of this server. Routes (each also under a per-execution prefix `/x/{execution_token}`):

- `POST /v1/chat/completions` — `messages` (+ `tools`) rendered with the byte chat template;
  the completion is parsed into `content`, `reasoning_content` and `tool_calls`.
- `POST /v1/completions` — `prompt` as a string or a list of token ids; `logprobs` supported.
- `GET /v1/models`.
- `POST /gyre/executions` — issue a per-execution endpoint (see `issue_execution_endpoint`).
- `POST /gyre/executions/{execution_id}/end` (or `POST /x/{token}/gyre/end`) — an external
  harness reports the end of an execution (`reward`, `kind` finished|truncated|failed).
- Admin (vLLM-style control routes used by `VLLMEngine`): `GET /is_sleeping`, `POST /sleep`,
  `POST /wake_up`, `POST /collective_rpc` (method `reload_weights`).

Who may call (checked before the body is read):
- `Authorization: Bearer <key>`. The run's API key (`rollout.openai_api_key`) may call the model
  routes; the admin key (`rollout.openai_admin_key`) may call everything, and only it the admin
  routes. A per-execution key (issued by the server) may call the model routes of its own
  execution only. No or wrong key -> 401; a key without the right -> 403. With no API key
  configured the model routes are open (the service never runs that way unless told to).
- A per-execution base URL `/x/{token}/v1` authenticates by its unguessable token alone, so an
  unmodified OpenAI client given `OPENAI_BASE_URL` lands in exactly one execution.

Which execution a call belongs to: the execution of the per-execution URL or key; else the one
named by header `X-Gyre-Execution-Id`, `metadata.execution_id` or `user`. A named execution
belongs to the key that opened it: another key naming the same id gets 403 (no hijacking a
predictable id), and server-issued executions belong to their own token. A call that names no
execution is refused with 400 and a message saying how to name one (docs/rollout.md). An
execution ends on `/end`, or after `execution_idle_s` without calls (it is then published as
TRUNCATED, so nothing is left open forever); later calls to an ended execution get 409.

Bad input: bodies are parsed by pydantic request models; a body larger than `max_request_bytes`
is refused (413) before it is parsed, a prompt longer than `max_prompt_tokens` characters (each
character is at least one byte token) before it is tokenised; tokenisation runs in a worker thread.
Wrong types -> 400 with the field and the reason, never a 500.

Token ids are captured server-side: every response carries Gyre extras `prompt_token_ids`,
`token_ids`, `token_logprobs` and `token_versions` (per choice), exactly what the engine saw and
produced, so nobody re-tokenises. Every call goes through the router (migration-safe) and becomes
one StepEvent; `call_seq` counts per execution in this process.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from gyre import tokenizer as tok
from gyre.errors import Conflict, GyreError, InvalidArgument, NotFound, PayloadTooLarge
from gyre.v1 import common_pb2, events_pb2

from .agent import ExecutionSpec, call_seed, step_event
from .engines.base import Completion, GenerationRequest, Sampling
from .environments.base import Progress
from .router import Router
from .steps import StepSink

_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_MAX_SEED = 2**63 - 1
_NAMING_HELP = (
    "this call names no execution. Use the per-execution base URL and key that "
    "POST /gyre/executions returns (OPENAI_BASE_URL=<base_url>, OPENAI_API_KEY=<api_key>), or name "
    "it with the header X-Gyre-Execution-Id (or metadata.execution_id, or the `user` field); "
    "see docs/rollout.md"
)


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body: {"error": {"message", "type", "code"}}."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "authentication_error")


def _forbidden(message: str) -> ApiError:
    return ApiError(403, message, "permission_error")


# -- request models ------------------------------------------------------------------------------
class _Body(BaseModel):
    """Base of request bodies: unknown fields (other clients' extensions) are ignored, known ones typed."""

    model_config = ConfigDict(extra="ignore")


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # Positive values below 1e-6 underflow the engine's float32 sampling (NaN log-probs): refused.
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, ge=1e-6, le=1)
    seed: int | None = Field(None, ge=0, le=_MAX_SEED)
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=64)
    n: Literal[1] = 1
    stream: Literal[False] = False
    user: str | None = None
    metadata: dict[str, str] | None = None

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < 1e-6:
            raise ValueError("temperature must be 0 (greedy) or at least 1e-6")
        return value


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: one prompt, a string or token ids (`[[ids]]` also accepted)."""

    prompt: str | list[StrictInt] | Annotated[list[list[StrictInt]], Field(min_length=1, max_length=1)]
    logprobs: StrictInt | StrictBool | None = None


class FunctionCall(_Body):
    name: str
    arguments: str = ""


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionSpec(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    logprobs: StrictBool | None = None


class EndRequest(_Body):
    """End of an execution reported by an external harness."""

    kind: Literal["finished", "truncated", "failed"] = "finished"
    reward: float | None = Field(None, allow_inf_nan=False)
    error: str = Field("", max_length=4096)


class IssueRequest(_Body):
    """`POST /gyre/executions`: open one execution and get its own base URL and key."""

    task_id: str = Field("openai", pattern=_ID.pattern)
    group_id: str | None = Field(None, pattern=_ID.pattern)
    execution_id: str | None = Field(None, pattern=_ID.pattern)


class CollectiveRpcKwargs(_Body):
    version: int = Field(ge=1)
    uri: str = Field(max_length=4096)
    sha256: str = ""


class CollectiveRpcRequest(_Body):
    method: Literal["reload_weights"]
    kwargs: CollectiveRpcKwargs


B = TypeVar("B", bound=BaseModel)


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "invalid request: " + "; ".join(parts)


# -- state -----------------------------------------------------------------------------------------
@dataclass
class Caller:
    """Who made a request: `admin`, `run` (the run's API key) or `execution` (a per-execution key/URL)."""

    kind: Literal["admin", "run", "execution"]
    key_id: str  # a short fingerprint of the credential; owner tag of the executions it opens
    execution_id: str | None = None


@dataclass
class _ExecutionState:
    spec: ExecutionSpec
    owner: str
    calls: int = 0
    last_call_s: float = field(default_factory=time.monotonic)


def _fingerprint(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()[:16]


class OpenAIEndpoint:
    """State behind the routes: router, step sink, credentials, executions and their owners.

    `api_key`: the run's key (None: model routes open). `admin_key`: the admin credential (None:
    admin routes refused). `max_prompt_tokens`: prompt bound (tokens; strings are bounded by
    characters before tokenising). `max_request_bytes`: body bound. `execution_idle_s`: seconds
    without a call after which an execution is ended as TRUNCATED, checked every `reap_interval_s`
    seconds. `public_url`: this server's base URL (`http://host:port`, set by `serve`), used in
    issued per-execution base URLs.
    """

    def __init__(
        self,
        router: Router,
        sink: StepSink,
        *,
        run_id: str,
        model_name: str = "gyre",
        seed: int = 0,
        api_key: str | None = None,
        admin_key: str | None = None,
        max_prompt_tokens: int = 4096,
        max_request_bytes: int = 8 << 20,
        execution_idle_s: float = 3600.0,
        reap_interval_s: float = 5.0,
        public_url: str = "",
    ) -> None:
        self.router, self.sink, self.run_id = router, sink, run_id
        self.model_name, self.seed = model_name, seed
        self.api_key, self.admin_key = api_key, admin_key
        self.max_prompt_tokens, self.max_request_bytes = max_prompt_tokens, max_request_bytes
        self.execution_idle_s, self.reap_interval_s = execution_idle_s, reap_interval_s
        self.public_url = public_url
        self.executions: dict[str, _ExecutionState] = {}
        self.sleeping = False
        self.weights_loader: Callable[[common_pb2.WeightVersion], Awaitable[None]] | None = None
        self._tokens: dict[str, str] = {}  # per-execution token -> execution id
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._last_reap_s = time.monotonic()

    # -- credentials ---------------------------------------------------------------------------
    def authenticate(self, request: Request) -> Caller:
        """The caller of `request`, from its per-execution URL token or its Bearer key; else 401."""
        token = request.path_params.get("exec_token")
        if token is not None:
            execution_id = self._tokens.get(token)
            if execution_id is None:
                raise _unauthorized("unknown or ended per-execution URL")
            return Caller("execution", f"x:{execution_id}", execution_id)
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header[:7].lower() == "bearer " else ""
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
            raise _unauthorized(
                "missing API key: send 'Authorization: Bearer <key>' (rollout.openai_api_key)"
            )
        raise _unauthorized("invalid API key")

    def require_admin(self, caller: Caller) -> None:
        if caller.kind != "admin":
            hint = "" if self.admin_key is not None else " (none is configured: rollout.openai_admin_key)"
            raise _forbidden("this route needs the admin key" + hint)

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
            if not _ID.match(value):
                raise InvalidArgument(f"{what} {value!r} must be 1-128 characters of [A-Za-z0-9_-]")
        if execution_id in self.executions or execution_id in self._ended:
            raise Conflict(f"execution {execution_id!r} already exists")
        token = secrets.token_urlsafe(24)
        spec = ExecutionSpec(
            self.run_id, task_id, group_id or f"{task_id}-g0", execution_id, "openai", seed=self.seed
        )
        self.executions[execution_id] = _ExecutionState(spec, owner=f"x:{execution_id}")
        self._tokens[token] = execution_id
        return execution_id, token

    async def execution(self, request: Request, caller: Caller, body: _Sampling) -> _ExecutionState:
        """The execution this call belongs to (see the module docstring), opened if new."""
        await self.reap_idle()
        meta = body.metadata or {}
        named = request.headers.get("x-gyre-execution-id") or meta.get("execution_id") or body.user
        if caller.execution_id is not None:
            if named and named != caller.execution_id and request.headers.get("x-gyre-execution-id"):
                raise _forbidden(f"this key belongs to execution {caller.execution_id!r}, not {named!r}")
            named = caller.execution_id
        if not named:
            raise InvalidArgument(_NAMING_HELP)
        task_id = request.headers.get("x-gyre-task-id") or meta.get("task_id") or "openai"
        for what, value in (("execution id", named), ("task id", task_id)):
            if not _ID.match(value):
                raise InvalidArgument(f"{what} {value[:200]!r} must be 1-128 characters of [A-Za-z0-9_-]")
        if named in self._ended:
            raise Conflict(f"execution {named!r} has ended; open a new one")
        state = self.executions.get(named)
        if state is None:
            group = request.headers.get("x-gyre-group-id") or meta.get("group_id") or f"{task_id}-g0"
            if not _ID.match(group):
                raise InvalidArgument(f"group id {group[:200]!r} must be 1-128 characters of [A-Za-z0-9_-]")
            spec = ExecutionSpec(self.run_id, task_id, group, named, "openai", seed=self.seed)
            state = self.executions[named] = _ExecutionState(spec, owner=caller.key_id)
        elif state.owner != caller.key_id and caller.kind != "admin":
            raise _forbidden(f"execution {named!r} belongs to another client")
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

    # -- generation ----------------------------------------------------------------------------
    def sampling(self, body: _Sampling, state: _ExecutionState) -> Sampling:
        max_tokens = body.max_completion_tokens or body.max_tokens or 64
        if max_tokens > self.max_prompt_tokens:
            raise InvalidArgument(
                f"max_tokens {max_tokens} exceeds the model's {self.max_prompt_tokens} positions"
            )
        stop = body.stop_token_ids
        if stop is not None and any(not 0 <= t < tok.VOCAB_SIZE for t in stop):
            raise InvalidArgument(f"stop_token_ids must be in [0, {tok.VOCAB_SIZE})")
        return Sampling(
            temperature=1.0 if body.temperature is None else body.temperature,
            max_tokens=max_tokens,
            seed=body.seed
            if body.seed is not None
            else call_seed(self.seed, state.spec.execution_id, state.calls),
            stop_token_ids=tuple(stop) if stop is not None else (tok.EOS,),
            top_p=1.0 if body.top_p is None else body.top_p,
        )

    def check_prompt_ids(self, prompt: list[int]) -> None:
        if not prompt:
            raise InvalidArgument("prompt must not be empty")
        if len(prompt) > self.max_prompt_tokens:
            raise InvalidArgument(f"prompt has {len(prompt)} tokens; at most {self.max_prompt_tokens}")
        if any(not 0 <= t < tok.VOCAB_SIZE for t in prompt):
            raise InvalidArgument(f"prompt token ids must be in [0, {tok.VOCAB_SIZE})")

    def check_prompt_chars(self, num_chars: int) -> None:
        """Bound a text prompt before tokenising: every character is at least one byte token."""
        if num_chars > self.max_prompt_tokens:
            raise InvalidArgument(
                f"prompt has {num_chars} characters, more than the {self.max_prompt_tokens} tokens allowed"
            )

    async def call(self, state: _ExecutionState, prompt: list[int], sampling: Sampling) -> Completion:
        if self.sleeping:
            raise Conflict("the engine is sleeping; POST /wake_up first")
        seq = state.calls
        state.calls += 1
        state.last_call_s = time.monotonic()
        started = time.time()
        request = GenerationRequest(
            f"{state.spec.execution_id}.{seq}", prompt, sampling, execution_id=state.spec.execution_id
        )
        completion = await self.router.generate(request)
        state.last_call_s = time.monotonic()
        await self.sink.publish_step(step_event(state.spec, seq, prompt, completion, Progress(), "", started))
        return completion

    async def parse(self, request: Request, model: type[B]) -> B:
        """The body of `request` as `model`: 413 beyond `max_request_bytes` (read in chunks), else 400."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            raise PayloadTooLarge(f"request body of {declared} bytes exceeds {self.max_request_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_request_bytes:
                raise PayloadTooLarge(f"request body exceeds {self.max_request_bytes} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            return model.model_validate_json(raw or b"{}")
        except ValidationError as exc:
            raise InvalidArgument(_validation_message(exc)) from None


def issue_execution_endpoint(
    endpoint: OpenAIEndpoint,
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


# -- response helpers ------------------------------------------------------------------------------
def _extras(prompt: list[int], c: Completion) -> dict[str, Any]:
    return {
        "prompt_token_ids": prompt,
        "token_ids": c.token_ids,
        "token_logprobs": c.logprobs,
        "token_versions": c.versions,
        "num_migrations": c.num_migrations,
        "engine_ids": c.engine_ids,
    }


def _response(
    response_id: str, kind: str, model: str, choice: dict[str, Any], prompt: list[int], c: Completion
) -> dict[str, Any]:
    """The OpenAI response envelope shared by completions and chat completions (one choice)."""
    return {
        "id": response_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(c.token_ids),
            "total_tokens": len(prompt) + len(c.token_ids),
        },
    }


def _finish(c: Completion, tool_calls: bool = False) -> str:
    return "tool_calls" if tool_calls else ("stop" if c.finish_reason == "stop" else "length")


def _tools_message(tools: list[Tool]) -> dict[str, Any]:
    lines = [json.dumps({"name": t.function.name, "parameters": t.function.parameters or {}}) for t in tools]
    return {
        "role": "system",
        "content": "Tools (call with <tool_call>{...}</tool_call>):\n" + "\n".join(lines),
    }


def _chat_messages(body: ChatRequest) -> list[dict[str, Any]]:
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    for m in messages:
        if m["role"] == "developer":
            m["role"] = "system"
    return [_tools_message(body.tools), *messages] if body.tools else messages


def _num_chars(value: Any) -> int:
    """Characters of every string inside a JSON-like value (a bound on its byte-token count)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_num_chars(k) + _num_chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_num_chars(v) for v in value)
    return 8


# -- routes ----------------------------------------------------------------------------------------
def _endpoint(request: Request) -> OpenAIEndpoint:
    return request.app.state.endpoint  # type: ignore[no-any-return]


def _caller(request: Request) -> Caller:
    return _endpoint(request).authenticate(request)


EndpointDep = Annotated[OpenAIEndpoint, Depends(_endpoint)]
CallerDep = Annotated[Caller, Depends(_caller)]

model_routes = APIRouter()


@model_routes.get("/v1/models")
async def list_models(endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": endpoint.model_name, "object": "model", "owned_by": "gyre"}]}


@model_routes.post("/v1/completions")
async def completions(request: Request, endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    body = await endpoint.parse(request, CompletionRequest)
    if isinstance(body.prompt, str):
        endpoint.check_prompt_chars(len(body.prompt))
        prompt = await asyncio.to_thread(tok.encode, body.prompt)
    elif body.prompt and isinstance(body.prompt[0], list):
        prompt = list(body.prompt[0])
    else:
        prompt = [t for t in body.prompt if isinstance(t, int)]
    endpoint.check_prompt_ids(prompt)
    state = await endpoint.execution(request, caller, body)
    c = await endpoint.call(state, prompt, endpoint.sampling(body, state))
    choice: dict[str, Any] = {"index": 0, "text": tok.decode(c.token_ids), "finish_reason": _finish(c)}
    if body.logprobs is not None and body.logprobs is not False:
        choice["logprobs"] = {
            "tokens": [tok.decode([t], skip_special=False) for t in c.token_ids],
            "token_logprobs": c.logprobs,
            "top_logprobs": None,
            "text_offset": None,
        }
    choice.update(_extras(prompt, c))
    response_id = f"cmpl-{state.spec.execution_id}-{state.calls - 1}"
    return _response(response_id, "text_completion", endpoint.model_name, choice, prompt, c)


@model_routes.post("/v1/chat/completions")
async def chat_completions(request: Request, endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    body = await endpoint.parse(request, ChatRequest)
    messages = _chat_messages(body)
    endpoint.check_prompt_chars(_num_chars(messages))
    prompt = await asyncio.to_thread(tok.apply_chat_template, messages)
    endpoint.check_prompt_ids(prompt)
    state = await endpoint.execution(request, caller, body)
    c = await endpoint.call(state, prompt, endpoint.sampling(body, state))
    turn = tok.parse_assistant(c.token_ids)
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    if turn.tool_calls:
        message["tool_calls"] = [
            {"id": f"{call.id}_{state.calls - 1}", "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for call in turn.tool_calls
        ]  # fmt: skip
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": _finish(c, bool(turn.tool_calls)),
    }
    if body.logprobs:
        choice["logprobs"] = {
            "content": [
                {
                    "token": tok.decode([t], skip_special=False),
                    "logprob": lp,
                    "bytes": None,
                    "top_logprobs": [],
                }
                for t, lp in zip(c.token_ids, c.logprobs, strict=True)
            ]
        }
    choice.update(_extras(prompt, c))
    response_id = f"chatcmpl-{state.spec.execution_id}-{state.calls - 1}"
    response = _response(response_id, "chat.completion", endpoint.model_name, choice, prompt, c)
    return {**response, **_extras(prompt, c)}


@model_routes.post("/gyre/end")
async def end_own_execution(request: Request, endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    """End the execution of a per-execution URL or key."""
    if caller.execution_id is None:
        raise InvalidArgument(
            "POST /gyre/end needs a per-execution URL or key; else use /gyre/executions/{id}/end"
        )
    return await _end(endpoint, caller, caller.execution_id, await endpoint.parse(request, EndRequest))


async def _end(
    endpoint: OpenAIEndpoint, caller: Caller, execution_id: str, body: EndRequest
) -> dict[str, Any]:
    state = endpoint.executions.get(execution_id)
    if state is not None and state.owner != caller.key_id and caller.kind != "admin":
        raise _forbidden(f"execution {execution_id!r} belongs to another client")
    num_calls = await endpoint.end(execution_id, body.kind, reward=body.reward, error=body.error)
    return {"execution_id": execution_id, "num_calls": num_calls}


control_routes = APIRouter()


@control_routes.post("/gyre/executions")
async def issue_execution(request: Request, endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    """Open an execution; returns its `base_url` and `api_key` (see issue_execution_endpoint)."""
    if caller.kind == "execution":
        raise _forbidden("a per-execution key cannot open executions")
    body = await endpoint.parse(request, IssueRequest)
    base_url, api_key = issue_execution_endpoint(
        endpoint, task_id=body.task_id, group_id=body.group_id, execution_id=body.execution_id
    )
    return {"execution_id": endpoint._tokens[api_key], "base_url": base_url, "api_key": api_key}


@control_routes.post("/gyre/executions/{execution_id}/end")
async def end_execution(
    execution_id: str, request: Request, endpoint: EndpointDep, caller: CallerDep
) -> dict[str, Any]:
    return await _end(endpoint, caller, execution_id, await endpoint.parse(request, EndRequest))


@control_routes.get("/is_sleeping")
async def is_sleeping(endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    endpoint.require_admin(caller)
    return {"is_sleeping": endpoint.sleeping}


@control_routes.post("/sleep")
async def sleep(endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    endpoint.require_admin(caller)
    endpoint.sleeping = True
    return {}


@control_routes.post("/wake_up")
async def wake_up(endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    endpoint.require_admin(caller)
    endpoint.sleeping = False
    return {}


@control_routes.post("/collective_rpc")
async def collective_rpc(request: Request, endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    """Admin: `reload_weights` — the same validation as a weights event (store, sha256, version)."""
    endpoint.require_admin(caller)
    body = await endpoint.parse(request, CollectiveRpcRequest)
    if endpoint.weights_loader is None:
        raise InvalidArgument("this server has no weight loader")
    kw = body.kwargs
    weights = common_pb2.WeightVersion(version=kw.version, uri=kw.uri, sha256=kw.sha256)
    await endpoint.weights_loader(weights)
    return {"results": [weights.version]}


_STATUS: list[tuple[type[GyreError], int]] = [
    (NotFound, 404), (PayloadTooLarge, 413), (InvalidArgument, 400), (Conflict, 409),
]  # fmt: skip


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def create_app(endpoint: OpenAIEndpoint) -> FastAPI:
    """The FastAPI app: model routes at `/` and under `/x/{exec_token}`, control routes, one error map."""
    app = FastAPI(title="Gyre rollout (OpenAI-compatible)", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.endpoint = endpoint
    app.include_router(model_routes)
    app.include_router(model_routes, prefix="/x/{exec_token}")
    app.include_router(control_routes)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        response = _error(exc.status, str(exc), exc.kind)
        if exc.status == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        return response

    @app.exception_handler(GyreError)
    async def _gyre_error(_: Request, exc: GyreError) -> JSONResponse:
        status = next((code for cls, code in _STATUS if isinstance(exc, cls)), 503)
        return _error(status, str(exc), type(exc).__name__)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, f"invalid request: {exc.errors()[:3]}", "InvalidArgument")

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
