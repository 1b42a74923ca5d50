"""vLLM engine: drives an external `vllm serve` through its OpenAI-compatible HTTP API (httpx).

vLLM stays an external server (and an optional extra); this client speaks:

- `POST /v1/completions` with `prompt` = a list of token ids, `return_token_ids: true`,
  `logprobs: 1`, `seed`, `stop_token_ids`, `skip_special_tokens: false`; reads `token_ids` and
  `logprobs.token_logprobs` of the choice (no re-tokenisation);
- `POST /sleep?level=1`, `POST /wake_up`, `GET /is_sleeping` (vLLM's dev-mode routes);
- `POST /collective_rpc` with `{"method": "reload_weights", "kwargs": {version, uri, sha256}}`.

It was tested only against Gyre's own OpenAI-compatible endpoint (services/rollout/openai/),
never against a real vLLM; docs/rollout.md lists what that leaves unverified. Differences from the
torch engine, by design of a remote server:

- `drain` aborts in-flight HTTP requests; they return "cut" with no tokens and the router
  re-runs them from their prompt elsewhere (tokens so far are not kept). With greedy decoding the
  result is the same; with sampling it is a fresh sample (vLLM's seed has no token offset).
- Weight reload happens between requests: `load_weights` stops admitting, waits for the requests
  in flight, reloads, then resumes; every token of a request carries the version it started with.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from gyre.errors import InvalidArgument, Unavailable
from gyre.v1 import common_pb2

from .base import Completion, Engine, EngineState, GenerationRequest


class VLLMEngine(Engine):
    def __init__(
        self,
        engine_id: str,
        device_id: str,
        base_url: str,
        *,
        model: str = "gyre",
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        # api_key: sent as `Authorization: Bearer` (vLLM's --api-key; Gyre's endpoint needs its admin key).
        self.api_key = api_key
        self.engine_id, self.device_id, self.model = engine_id, device_id, model
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None
        self._state = EngineState.SERVING
        self._version = 0
        self._inflight: set[asyncio.Task[Completion]] = set()
        self._admit = asyncio.Event()
        self._admit.set()
        self._tokens = 0
        self._prompt_tokens = 0  # prompt tokens of the requests in flight

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def num_active(self) -> int:
        return len(self._inflight)

    # num_generating keeps the base default (every request in flight): which of them vLLM has
    # scheduled is in its /metrics gauges only, an HTTP call, while these properties are read
    # synchronously on every load report.

    @property
    def context_tokens(self) -> int:
        """Prompt tokens of the requests in flight: a lower bound of their context, since the tokens
        vLLM has generated so far arrive only with the (non-streamed) response."""
        return self._prompt_tokens

    @property
    def tokens_generated(self) -> int:
        return self._tokens

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s, headers=headers)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            raise Unavailable(f"engine {self.engine_id} not started")
        return self._client

    async def _post(self, path: str, **kwargs: Any) -> Any:
        try:
            resp = await self._http().post(path, **kwargs)
        except httpx.HTTPError as exc:
            raise Unavailable(f"vLLM server {self.base_url} unreachable: {exc!r}") from exc
        if resp.status_code == 400:
            raise InvalidArgument(f"vLLM rejected {path}: {resp.text[:500]}")
        if resp.status_code >= 300:
            raise Unavailable(f"vLLM {path} answered {resp.status_code}: {resp.text[:500]}")
        return resp.json() if resp.content else {}

    async def _complete(self, request: GenerationRequest, version: int) -> Completion:
        s = request.sampling
        body = {
            "model": self.model,
            "prompt": request.prompt_ids,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": s.seed,
            "stop_token_ids": list(s.stop_token_ids),
            "logprobs": 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "user": request.execution_id or None,
        }
        data = await self._post("/v1/completions", json=body)
        choice = data["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        if len(lps) != len(ids):
            raise Unavailable(f"vLLM returned {len(ids)} token ids but {len(lps)} log-probs")
        self._tokens += len(ids)
        reason = "stop" if choice.get("finish_reason") == "stop" else "length"
        return Completion(ids, lps, [version] * len(ids), reason, [self.engine_id])

    async def generate(self, request: GenerationRequest) -> Completion:
        await self._admit.wait()
        if self._state is not EngineState.SERVING:
            return Completion(finish_reason="cut", engine_ids=[self.engine_id])
        task = asyncio.create_task(self._complete(request, self._version))
        self._inflight.add(task)
        self._prompt_tokens += len(request.prompt_ids)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and self._state is not EngineState.SERVING:
                return Completion(finish_reason="cut", engine_ids=[self.engine_id])
            task.cancel()
            raise
        finally:
            self._inflight.discard(task)
            self._prompt_tokens -= len(request.prompt_ids)

    async def load_weights(self, weights: common_pb2.WeightVersion) -> None:
        if weights.version <= self._version:
            return
        self._admit.clear()
        try:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
            kwargs = {"version": int(weights.version), "uri": weights.uri, "sha256": weights.sha256}
            await self._post("/collective_rpc", json={"method": "reload_weights", "kwargs": kwargs})
            self._version = int(weights.version)
        finally:
            self._admit.set()

    async def sleep(self, level: int = 1) -> None:
        await self._post("/sleep", params={"level": str(level)})

    async def wake_up(self) -> None:
        await self._post("/wake_up")

    async def is_sleeping(self) -> bool:
        resp = await self._http().get("/is_sleeping")
        return bool(resp.json()["is_sleeping"])

    async def drain(self) -> None:
        self._state = EngineState.DRAINING
        self._admit.set()
        for task in list(self._inflight):
            task.cancel()
        await asyncio.gather(*list(self._inflight), return_exceptions=True)
        self._state = EngineState.STOPPED

    async def close(self) -> None:
        await self.drain()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
