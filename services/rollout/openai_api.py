"""OpenAI-compatible HTTP endpoint inside the rollout service (FastAPI, served by uvicorn).

So that an existing agent harness can be trained unchanged: point its OpenAI client at
`http://<rollout>:<port>/v1`. Routes:

- `POST /v1/chat/completions` — `messages` (+ `tools`) rendered with the byte chat template;
  the completion is parsed into `content`, `reasoning_content` and `tool_calls`.
- `POST /v1/completions` — `prompt` as a string or a list of token ids; `logprobs` supported.
- vLLM-style control routes used by `VLLMEngine` (and so tested against this server): `GET
  /is_sleeping`, `POST /sleep`, `POST /wake_up`, `POST /collective_rpc` (method `reload_weights`).
- `POST /gyre/executions/{execution_id}/end` — an external harness reports the end of an
  execution (`reward`, `kind` finished|truncated|failed) -> ExecutionEvent.

Token ids are captured server-side: every response carries Gyre extras `prompt_token_ids`,
`token_ids`, `token_logprobs` and `token_versions` (per choice), exactly what the engine saw and
produced, so nobody re-tokenises. Every call goes through the router (migration-safe) and becomes
one StepEvent. Its execution is named by header `X-Gyre-Execution-Id`, else `metadata.execution_id`,
else the `user` field; calls without one get a fresh execution each. `X-Gyre-Task-Id` /
`metadata.task_id` name the task (default "openai"); `call_seq` counts per execution in this process.
"""

from __future__ import annotations

import itertools
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gyre import tokenizer as tok
from gyre.errors import GyreError, InvalidArgument, NotFound
from gyre.v1 import common_pb2, events_pb2

from .agent import ExecutionSpec, call_seed, step_event
from .engines.base import Completion, GenerationRequest, Sampling
from .environments.base import Progress
from .router import Router
from .steps import StepSink

_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


@dataclass
class _ExecutionState:
    spec: ExecutionSpec
    calls: int = 0


class OpenAIEndpoint:
    """State behind the routes: the router, the step sink and per-execution call counters."""

    def __init__(
        self, router: Router, sink: StepSink, *, run_id: str, model_name: str = "gyre", seed: int = 0
    ) -> None:
        self.router, self.sink, self.run_id, self.model_name, self.seed = (
            router,
            sink,
            run_id,
            model_name,
            seed,
        )
        self.executions: dict[str, _ExecutionState] = {}
        self.sleeping = False
        self._anon = itertools.count()
        self.weights_loader: Any = None  # async callable(WeightVersion) set by the service

    def execution(self, request: Request, body: dict[str, Any]) -> _ExecutionState:
        meta = body.get("metadata") or {}
        exec_id = request.headers.get("x-gyre-execution-id") or meta.get("execution_id") or body.get("user")
        task_id = request.headers.get("x-gyre-task-id") or meta.get("task_id") or "openai"
        if not exec_id:
            exec_id = f"{task_id}-anon{next(self._anon)}-{uuid.uuid4().hex[:8]}"
        for what, value in (("execution id", exec_id), ("task id", task_id)):
            if not isinstance(value, str) or not _ID.match(value):
                raise InvalidArgument(f"{what} {value!r} must be 1-128 characters of [A-Za-z0-9_-]")
        state = self.executions.get(exec_id)
        if state is None:
            group = request.headers.get("x-gyre-group-id") or meta.get("group_id") or f"{task_id}-g0"
            spec = ExecutionSpec(self.run_id, task_id, group, exec_id, "openai", seed=self.seed)
            state = self.executions[exec_id] = _ExecutionState(spec)
        return state

    def sampling(self, body: dict[str, Any], state: _ExecutionState) -> Sampling:
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 64
        temperature = body.get("temperature")
        top_p = body.get("top_p")
        seed = body.get("seed")
        stop_ids = body.get("stop_token_ids")
        return Sampling(
            temperature=1.0 if temperature is None else float(temperature),
            max_tokens=int(max_tokens),
            seed=int(seed)
            if seed is not None
            else call_seed(self.seed, state.spec.execution_id, state.calls),
            stop_token_ids=tuple(int(t) for t in stop_ids) if stop_ids is not None else (tok.EOS,),
            top_p=1.0 if top_p is None else float(top_p),
        )

    async def call(self, state: _ExecutionState, prompt: list[int], sampling: Sampling) -> Completion:
        if self.sleeping:
            raise InvalidArgument("the engine is sleeping; POST /wake_up first")
        seq = state.calls
        state.calls += 1
        started = time.time()
        request = GenerationRequest(
            f"{state.spec.execution_id}.{seq}", prompt, sampling, execution_id=state.spec.execution_id
        )
        completion = await self.router.generate(request)
        await self.sink.publish_step(step_event(state.spec, seq, prompt, completion, Progress(), "", started))
        return completion


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


def _tools_message(tools: list[dict[str, Any]]) -> dict[str, Any]:
    specs = [t.get("function", t) for t in tools]
    lines = [json.dumps({"name": s.get("name"), "parameters": s.get("parameters", {})}) for s in specs]
    return {
        "role": "system",
        "content": "Tools (call with <tool_call>{...}</tool_call>):\n" + "\n".join(lines),
    }


def create_app(endpoint: OpenAIEndpoint) -> FastAPI:
    app = FastAPI(title="Gyre rollout (OpenAI-compatible)")

    @app.exception_handler(GyreError)
    async def _gyre_error(_: Request, exc: GyreError) -> JSONResponse:
        status = 404 if isinstance(exc, NotFound) else 400 if isinstance(exc, InvalidArgument) else 503
        return JSONResponse({"error": {"message": str(exc), "type": type(exc).__name__}}, status_code=status)

    async def _body(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise InvalidArgument(f"request body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise InvalidArgument("request body must be a JSON object")
        return body

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": endpoint.model_name, "object": "model", "owned_by": "gyre"}],
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await _body(request)
        raw = body.get("prompt")
        if isinstance(raw, str):
            prompt = tok.encode(raw)
        elif isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
            prompt = list(raw)
        elif isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], list):
            prompt = [int(t) for t in raw[0]]
        else:
            raise InvalidArgument("prompt must be a non-empty string or a list of token ids")
        if any(not 0 <= t < tok.VOCAB_SIZE for t in prompt):
            raise InvalidArgument(f"prompt token ids must be in [0, {tok.VOCAB_SIZE})")
        state = endpoint.execution(request, body)
        c = await endpoint.call(state, prompt, endpoint.sampling(body, state))
        choice: dict[str, Any] = {"index": 0, "text": tok.decode(c.token_ids), "finish_reason": _finish(c)}
        if body.get("logprobs") is not None:
            choice["logprobs"] = {
                "tokens": [tok.decode([t], skip_special=False) for t in c.token_ids],
                "token_logprobs": c.logprobs,
                "top_logprobs": None,
                "text_offset": None,
            }
        choice.update(_extras(prompt, c))
        return _response(
            f"cmpl-{state.spec.execution_id}-{state.calls - 1}",
            "text_completion",
            endpoint.model_name,
            choice,
            prompt,
            c,
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await _body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidArgument("messages must be a non-empty list")
        if body.get("stream"):
            raise InvalidArgument("stream=true is not supported by the Gyre endpoint")
        if body.get("tools"):
            messages = [_tools_message(body["tools"]), *messages]
        prompt = tok.apply_chat_template(messages)
        state = endpoint.execution(request, body)
        c = await endpoint.call(state, prompt, endpoint.sampling(body, state))
        turn = tok.parse_assistant(c.token_ids)
        message: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.reasoning:
            message["reasoning_content"] = turn.reasoning
        if turn.tool_calls:
            message["tool_calls"] = [
                {
                    "id": f"{call.id}_{state.calls - 1}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in turn.tool_calls
            ]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": _finish(c, bool(turn.tool_calls)),
        }
        if body.get("logprobs"):
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
        response = _response(
            f"chatcmpl-{state.spec.execution_id}-{state.calls - 1}",
            "chat.completion",
            endpoint.model_name,
            choice,
            prompt,
            c,
        )
        return {**response, **_extras(prompt, c)}

    @app.post("/gyre/executions/{execution_id}/end")
    async def end_execution(execution_id: str, request: Request) -> dict[str, Any]:
        body = await _body(request)
        state = endpoint.executions.pop(execution_id, None)
        if state is None:
            raise NotFound(f"no execution {execution_id!r} made calls through this endpoint")
        kinds = {"finished": events_pb2.ExecutionEvent.KIND_FINISHED, "truncated": events_pb2.ExecutionEvent.KIND_TRUNCATED,
                 "failed": events_pb2.ExecutionEvent.KIND_FAILED}  # fmt: skip
        kind = kinds.get(str(body.get("kind", "finished")))
        if kind is None:
            raise InvalidArgument(f"kind must be one of {sorted(kinds)}")
        ev = events_pb2.ExecutionEvent(
            event_id=f"{execution_id}.end", run_id=state.spec.run_id, task_id=state.spec.task_id,
            group_id=state.spec.group_id, execution_id=execution_id, kind=kind, num_calls=state.calls,
            environment="openai", error=str(body.get("error", "")), created_unix_s=time.time(),
        )  # fmt: skip
        if body.get("reward") is not None:
            reward = float(body["reward"])
            if reward != reward:
                raise InvalidArgument("reward is NaN")
            ev.reward = reward
        await endpoint.sink.publish_execution(ev)
        return {"execution_id": execution_id, "num_calls": state.calls}

    # -- vLLM-style control routes (what VLLMEngine calls) ----------------------------------------
    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, Any]:
        return {"is_sleeping": endpoint.sleeping}

    @app.post("/sleep")
    async def sleep() -> dict[str, Any]:
        endpoint.sleeping = True
        return {}

    @app.post("/wake_up")
    async def wake_up() -> dict[str, Any]:
        endpoint.sleeping = False
        return {}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> dict[str, Any]:
        body = await _body(request)
        if body.get("method") != "reload_weights":
            raise InvalidArgument("only method 'reload_weights' is supported")
        kwargs = body.get("kwargs") or {}
        weights = common_pb2.WeightVersion(
            version=int(kwargs["version"]), uri=str(kwargs["uri"]), sha256=str(kwargs.get("sha256", ""))
        )
        if endpoint.weights_loader is None:
            raise InvalidArgument("this server has no weight loader")
        await endpoint.weights_loader(weights)
        return {"results": [weights.version]}

    return app


async def serve(app: FastAPI, host: str, port: int) -> tuple[Any, int]:
    """Start uvicorn in this event loop; returns (server, bound port). Stop with `server.should_exit = True`."""
    import asyncio
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
    task = asyncio.create_task(server.serve(), name="openai-http")
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    server.gyre_task = task  # type: ignore[attr-defined]
    return server, int(bound)
