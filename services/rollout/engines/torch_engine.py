"""Torch engine: the shared Megatron GPT (gyre.model) with a KV cache and continuous batching.

One asyncio task runs the engine loop; each model call runs in a worker thread so the event
loop (agents, gRPC, HTTP) stays responsive::

    loop:  apply a pending weight load      <- safe point: no forward pass in flight
           if draining: cut every request at its current token, answer it, stop
           admit queued requests (prefill each; sample its first token)
           one batched decode step for every running sequence (sample one token each)
           answer the finished ones (stop token or max_tokens)

Waits on: new requests when idle. Back-pressure: at most `max_batch` sequences decode at once;
the rest wait in the queue (counted in num_active). Works on CPU and CUDA (`torch_device`).

Failure: a prompt that is not a list of int token ids inside the vocabulary is refused in
`generate` (InvalidArgument) before it reaches the loop. If the loop still raises, every request
queued or running fails with Unavailable naming the error, later requests fail the same way at
once, the engine is STOPPED, and the loop task is handed to `gyre.service.supervise`: the service
goes NOT_SERVING and exits 1 so its supervisor restarts it (never a zombie that says SERVING).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from gyre.errors import InvalidArgument, Unavailable
from gyre.model import ModelConfig
from gyre.service import supervise
from gyre.v1 import common_pb2

from .base import Completion, Engine, EngineState, GenerationRequest
from .sampling import sample_token

log = logging.getLogger(__name__)


@dataclass
class _Sequence:
    request: GenerationRequest
    future: asyncio.Future[Completion]
    cache: Any = None
    out: Completion = field(default_factory=Completion)
    finished: str = ""

    @property
    def next_position(self) -> int:
        return len(self.request.prompt_ids) + len(self.out.token_ids)


class TorchEngine(Engine):
    def __init__(
        self,
        engine_id: str,
        device_id: str,
        model_config: ModelConfig | None = None,
        *,
        torch_device: str = "cpu",
        max_batch: int = 32,
        init_seed: int = 0,
        initial_weights: common_pb2.WeightVersion | None = None,
        init_weights: str | None = None,
    ) -> None:
        self.engine_id, self.device_id = engine_id, device_id
        self.model_config = model_config or ModelConfig.model_validate({})
        self.torch_device = torch.device(torch_device)
        self.max_batch = max_batch
        self.init_seed = init_seed
        self._initial = initial_weights
        self.init_weights = init_weights  # version 0: an HF checkpoint dir or safetensors (gyre.model.hf)
        self._model: Any = None
        self._version = 0
        self._state = EngineState.SERVING
        self._queue: list[_Sequence] = []
        self._running: list[_Sequence] = []
        self._wake = asyncio.Event()
        self._pending_weights: list[tuple[common_pb2.WeightVersion, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._drained = asyncio.Event()
        self._tokens_generated = 0
        self._failure: BaseException | None = None  # why the loop died, once it did

    # -- Engine interface --------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def num_active(self) -> int:
        return len(self._queue) + len(self._running)

    @property
    def tokens_generated(self) -> int:
        return self._tokens_generated

    async def start(self) -> None:
        from gyre.model import build_model

        self._model = await asyncio.to_thread(
            build_model, self.model_config, device=self.torch_device, dtype=torch.float32, seed=self.init_seed
        )
        self._model.eval()
        if self.init_weights:
            from gyre.model.hf import load_initial_weights

            await asyncio.to_thread(load_initial_weights, self._model, self.init_weights)
        if self._initial is not None and self._initial.version > 0:
            await asyncio.to_thread(self._load, self._initial)
        self._task = supervise(
            asyncio.create_task(self._loop(), name=f"engine-{self.engine_id}"), f"engine-{self.engine_id}"
        )

    def _check_prompt(self, request: GenerationRequest) -> None:
        """InvalidArgument unless the prompt is a list of int token ids in [0, vocab_size)."""
        ids = request.prompt_ids
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)]
        if not isinstance(ids, list) or bad:
            raise InvalidArgument(
                f"request {request.request_id!r}: prompt must be a list of integer token ids, "
                f"got {type(bad[0]).__name__ if bad else type(ids).__name__} {bad[0] if bad else ''!r}"
            )
        if max(ids) >= self.model_config.vocab_size or min(ids) < 0:
            raise InvalidArgument(
                f"request {request.request_id!r}: token id outside [0, {self.model_config.vocab_size})"
            )

    async def generate(self, request: GenerationRequest) -> Completion:
        if self._failure is not None:
            raise Unavailable(f"engine {self.engine_id} failed: {self._failure!r}")
        if self._state is not EngineState.SERVING or self._task is None:
            return Completion(
                finish_reason="cut", engine_ids=[self.engine_id]
            )  # not admitted: resume elsewhere
        self._check_prompt(request)
        if len(request.prompt_ids) + request.sampling.max_tokens > self.model_config.max_position_embeddings:
            raise InvalidArgument(
                f"request {request.request_id!r}: prompt ({len(request.prompt_ids)}) + max_tokens "
                f"({request.sampling.max_tokens}) exceeds the model's {self.model_config.max_position_embeddings} positions"
            )
        seq = _Sequence(request, asyncio.get_running_loop().create_future())
        seq.out.engine_ids.append(self.engine_id)
        self._queue.append(seq)
        self._wake.set()
        try:
            return await asyncio.shield(seq.future)
        except asyncio.CancelledError:
            seq.finished = "cancelled"  # the loop drops it at the next step
            raise

    async def load_weights(self, weights: common_pb2.WeightVersion) -> None:
        if weights.version <= self._version:
            return
        if self._task is None or self._task.done():
            raise Unavailable(f"engine {self.engine_id} is not running; cannot load weights")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending_weights.append((weights, done))
        self._wake.set()
        await done

    async def drain(self) -> None:
        if self._state is EngineState.SERVING:
            self._state = EngineState.DRAINING
            self._wake.set()
        if self._task is not None and not self._task.done():
            await self._drained.wait()
        self._state = EngineState.STOPPED

    async def close(self) -> None:
        await self.drain()
        if self._task is not None and self._failure is None:
            await self._task
        self._model = None

    # -- the loop ----------------------------------------------------------------------------
    async def _loop(self) -> None:
        try:
            while True:
                if not (
                    self._queue
                    or self._running
                    or self._pending_weights
                    or self._state is not EngineState.SERVING
                ):
                    self._wake.clear()
                    await self._wake.wait()
                await self._apply_weights()
                if self._state is not EngineState.SERVING:
                    self._cut_all()
                    return
                self._drop_cancelled()
                admitted = self._queue[: max(0, self.max_batch - len(self._running))]
                del self._queue[: len(admitted)]
                if admitted:
                    await asyncio.to_thread(self._prefill, admitted)
                    self._running += admitted
                    self._answer_finished()
                if self._running:
                    await asyncio.to_thread(self._decode, list(self._running))
                    self._answer_finished()
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self._failure = exc
                log.error("engine %s loop failed: %r", self.engine_id, exc)
            self._state = EngineState.STOPPED
            for seq in self._queue + self._running:
                if not seq.future.done():
                    seq.future.set_exception(Unavailable(f"engine {self.engine_id} failed: {exc!r}"))
            self._queue, self._running = [], []
            for _weights, done in self._pending_weights:
                if not done.done():
                    done.set_exception(Unavailable(f"engine {self.engine_id} failed: {exc!r}"))
            self._pending_weights = []
            raise
        finally:
            self._drained.set()

    async def _apply_weights(self) -> None:
        while self._pending_weights:
            weights, done = self._pending_weights.pop(0)
            try:
                if weights.version > self._version:
                    await asyncio.to_thread(self._load, weights)
                done.set_result(None)
            except Exception as exc:  # a bad file must not kill the engine: the caller hears why
                done.set_exception(exc)

    def _load(self, weights: common_pb2.WeightVersion) -> None:
        from gyre.model import load_weights

        path = weights.uri.removeprefix("file://")
        load_weights(self._model, path, expected_sha256=weights.sha256 or None)
        self._version = int(weights.version)
        log.info("engine %s loaded weights v%d", self.engine_id, self._version)

    def _cut_all(self) -> None:
        for seq in self._queue + self._running:
            if not seq.future.done():
                seq.out.finish_reason = "cut"
                seq.future.set_result(seq.out)
        self._queue, self._running = [], []

    def _drop_cancelled(self) -> None:
        self._queue = [s for s in self._queue if s.finished != "cancelled"]
        self._running = [s for s in self._running if s.finished != "cancelled"]

    def _record(self, seq: _Sequence, logits: torch.Tensor) -> None:
        req = seq.request
        tok, logprob = sample_token(logits, req.sampling, req.token_offset + len(seq.out.token_ids))
        seq.out.token_ids.append(tok)
        seq.out.logprobs.append(logprob)
        seq.out.versions.append(self._version)
        self._tokens_generated += 1
        if tok in req.sampling.stop_token_ids:
            seq.finished = "stop"
        elif len(seq.out.token_ids) >= req.sampling.max_tokens:
            seq.finished = "length"

    def _prefill(self, seqs: list[_Sequence]) -> None:
        from gyre.model import KVCache, prefill

        for seq in seqs:
            ids = seq.request.prompt_ids
            seq.cache = KVCache()
            dev = self.torch_device
            logits = prefill(
                self._model, seq.cache, torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev)
            )
            self._record(seq, logits[-1])

    def _decode(self, seqs: list[_Sequence]) -> None:
        from gyre.model import decode_step

        live = [s for s in seqs if not s.finished]
        if not live:
            return
        dev = self.torch_device
        last = torch.tensor([s.out.token_ids[-1] for s in live], device=dev)
        positions = torch.tensor([s.next_position - 1 for s in live], device=dev)
        logits = decode_step(self._model, [s.cache for s in live], last, positions)
        for row, seq in zip(logits, live, strict=True):
            self._record(seq, row)

    def _answer_finished(self) -> None:
        still = []
        for seq in self._running:
            if seq.finished in {"stop", "length"}:
                seq.out.finish_reason = seq.finished
                seq.cache = None
                if not seq.future.done():
                    seq.future.set_result(seq.out)
            elif seq.finished != "cancelled":
                still.append(seq)
        self._running = still
