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

Paced devices (gyre/pacing.py, `devices.pacing`): each admitted sequence gets a deadline, its turn
priced by the cost model (prefill or, after a migration, the KV copy, then its modelled tokens at the
engine's decode step time for every sequence decoding when it is admitted); the real tokens are
computed at once and the completion is answered no earlier than the deadline. A sequence cut by a
drain before its deadline keeps only the share of its tokens the modelled time covered (the rest is
generated again where it resumes, from the same seed). A new weight version stalls admission for
`weight_sync_s`. The loop waits with asyncio (never a busy loop); with pacing off nothing waits.

Failure: a prompt that is not a list of int token ids inside the vocabulary is refused in
`generate` (InvalidArgument) before it reaches the loop. If the loop still raises, every request
queued or running fails with `EngineFailed` (an Unavailable naming the error, carrying what was
generated so far, so the router resumes it elsewhere as a migration; a request already complete
is answered), later requests fail the same way at once, and the engine is STOPPED. Who hears of
it: with `on_failure` (the rollout service's engine restarter, services/rollout/engine_recovery.py)
that callback, which restarts the engine while the service lives on; without it, the loop task is
handed to `gyre.service.supervise`: the service goes NOT_SERVING and exits 1 so its supervisor
restarts it (never a zombie that says SERVING).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gyre.errors import InvalidArgument, Unavailable
from gyre.model import ModelConfig
from gyre.pacing import Pacer
from gyre.service import supervise
from gyre.v1 import common_pb2

from .base import Completion, Engine, EngineFailed, EngineState, GenerationRequest
from .sampling import sample_token

log = logging.getLogger(__name__)


@dataclass
class _Sequence:
    request: GenerationRequest
    future: asyncio.Future[Completion]
    cache: Any = None
    out: Completion = field(default_factory=Completion)
    finished: str = ""
    # paced devices: monotonic admission time and deadline (0: unpaced), modelled context decoding
    started: float = 0.0
    due: float = 0.0
    modeled_context: float = 0.0

    @property
    def next_position(self) -> int:
        return len(self.request.prompt_ids) + len(self.out.token_ids)


class EngineFault(RuntimeError):
    """An injected device fault (TorchEngine.inject_fault): the engine's loop dies with it."""


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
        pacer: Pacer | None = None,
        on_failure: Callable[[TorchEngine, BaseException], None] | None = None,
    ) -> None:
        self.engine_id, self.device_id = engine_id, device_id
        self.on_failure = on_failure  # None: a loop failure is fatal to the service (module doc)
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
        self._injected_fault: str | None = None  # set by inject_fault: the loop raises it next step
        self._pacer = pacer or Pacer()  # off unless devices.pacing is on
        self._stall_until = 0.0  # paced: no admission before this monotonic time (weight sync)
        self._held_since: float | None = None  # pacer-clock time the decode batch last became non-empty
        self._held_s = 0.0  # seconds of finished non-empty-batch intervals

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
    def num_generating(self) -> int:
        """Sequences admitted to the decode batch (prefilled, holding a KV cache), at most max_batch."""
        return len(self._running)

    @property
    def context_tokens(self) -> int:
        """Positions the admitted sequences hold in their KV caches (prompt plus tokens so far)."""
        return sum(s.next_position for s in self._running)

    @property
    def busy_s(self) -> float:
        """Seconds the decode batch has held at least one sequence (prefill and decode time)."""
        held = self._held_s
        if self._held_since is not None:
            held += self._pacer.clock() - self._held_since
        return held

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
        task = asyncio.create_task(self._loop(), name=f"engine-{self.engine_id}")
        if self.on_failure is None:
            self._task = supervise(task, f"engine-{self.engine_id}")
        else:
            self._task = task
            task.add_done_callback(self._report_failure)

    def _report_failure(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None or self.on_failure is None:
            return
        exc = task.exception()
        assert exc is not None
        self.on_failure(self, exc)

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
            raise EngineFailed(
                f"engine {self.engine_id} failed: {self._failure!r}",
                Completion(finish_reason="cut", engine_ids=[self.engine_id]),
            )
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
        """Drain, drop the model and give its device memory back (the device may go to training).

        On CUDA the caching allocator's free blocks are returned to the driver (`empty_cache`), so the
        trainer sees the memory free; the CUDA context itself (a few hundred MB) lives as long as the
        rollout process — a process cannot drop it and keep using CUDA elsewhere."""
        await self.drain()
        if self._task is not None and self._failure is None:
            await self._task
        self._model = None
        release_device_memory(self.torch_device)

    def inject_fault(self, reason: str) -> None:
        """Chaos testing (rollout.fault_injection): the loop raises EngineFault(`reason`) at its next
        step, exactly as if its device failed there; what follows is the real crash path (every held
        request answered EngineFailed with its tokens so far, `on_failure` called)."""
        self._injected_fault = reason
        self._wake.set()

    # -- the loop ----------------------------------------------------------------------------
    async def _loop(self) -> None:
        try:
            while True:
                if not (
                    self._queue
                    or self._running
                    or self._pending_weights
                    or self._state is not EngineState.SERVING
                    or self._injected_fault
                ):
                    self._wake.clear()
                    await self._wake.wait()
                if self._injected_fault:
                    raise EngineFault(self._injected_fault)
                await self._apply_weights()
                if self._state is not EngineState.SERVING:
                    self._cut_all()
                    return
                self._drop_cancelled()
                now = self._pacer.clock()
                room = max(0, self.max_batch - len(self._running))
                admitted = self._queue[:room] if now >= self._stall_until else []
                del self._queue[: len(admitted)]
                if admitted:
                    if self._held_since is None:
                        self._held_since = self._pacer.clock()
                    await asyncio.to_thread(self._prefill, admitted)
                    self._pace(admitted, now)
                    self._running += admitted
                    self._answer_finished()
                if any(not s.finished for s in self._running):
                    await asyncio.to_thread(self._decode, list(self._running))
                    self._answer_finished()
                elif self._running or (self._queue and not admitted):
                    self._answer_finished()  # paced: deadlines that passed meanwhile
                    await self._wait_paced()
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self._failure = exc
                log.error("engine %s loop failed: %r", self.engine_id, exc)
            self._state = EngineState.STOPPED
            for seq in self._queue + self._running:
                if seq.future.done():
                    continue
                if seq.finished in {"stop", "length"}:  # complete: answer it (a paced deadline is moot now)
                    seq.out.finish_reason = seq.finished
                    seq.future.set_result(seq.out)
                    continue
                seq.out.finish_reason = "cut"
                seq.future.set_exception(EngineFailed(f"engine {self.engine_id} failed: {exc!r}", seq.out))
            self._queue, self._running = [], []
            self._note_idle()
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
                    t0 = self._pacer.clock()
                    await asyncio.to_thread(self._load, weights)
                    if self._pacer.enabled:  # new turns wait for the modelled weight sync
                        wall = self._pacer.request("weight_sync", t0, self._pacer.weight_sync_s())
                        self._stall_until = max(self._stall_until, self._pacer.clock() + wall)
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
        now = self._pacer.clock()
        for seq in self._queue + self._running:
            if not seq.future.done():
                if seq.due > now:  # paced: only the tokens the modelled time covered are out
                    self._truncate_to_modeled(seq, now)
                seq.out.finish_reason = "cut"
                seq.future.set_result(seq.out)
        self._queue, self._running = [], []
        self._note_idle()

    # -- paced devices (gyre/pacing.py) -----------------------------------------------------------
    def _pace(self, admitted: list[_Sequence], now: float) -> None:
        """Give each admitted sequence its deadline: its turn priced by the cost model against the
        modelled context of every sequence decoding on this engine (itself included)."""
        if not self._pacer.enabled:
            return
        decoding = sum(s.modeled_context for s in self._running if s.due > now)
        for seq in admitted:
            req = seq.request
            turn = self._pacer.turn_of(
                req.execution_id, len(req.prompt_ids), req.sampling.max_tokens, req.token_offset
            )
            seq.modeled_context = turn.context_tokens + turn.new_tokens
            modeled = self._pacer.generation_s(turn, decoding, resumed=req.token_offset > 0)
            decoding += seq.modeled_context
            seq.started = now
            seq.due = self._pacer.deadline(now, modeled)
            self._pacer.request("generate", now, modeled)

    def _truncate_to_modeled(self, seq: _Sequence, now: float) -> None:
        """Keep the share of the tokens the elapsed modelled time covers (at least one fewer than all,
        so the resumed request has tokens left to generate)."""
        n = len(seq.out.token_ids)
        share = (now - seq.started) / (seq.due - seq.started) if seq.due > seq.started else 1.0
        keep = min(n - 1, int(n * max(0.0, share))) if n else 0
        out = seq.out
        out.token_ids, out.logprobs, out.versions = (
            out.token_ids[:keep],
            out.logprobs[:keep],
            out.versions[:keep],
        )

    async def _wait_paced(self) -> None:
        """Nothing to decode: wait for the next deadline, the end of a weight-sync stall, or news."""
        now = self._pacer.clock()
        if self._queue and len(self._running) < self.max_batch and self._stall_until <= now:
            return  # a request came in meanwhile: admit it first
        times = [s.due for s in self._running if s.due > now]
        if self._queue and self._stall_until > now:
            times.append(self._stall_until)
        self._wake.clear()
        if not times:
            return
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, min(times) - now))
        except TimeoutError:
            pass

    def _note_idle(self) -> None:
        """The engine holds no sequence any more: close the busy interval and log it (gyre/pacing.py)."""
        if self._held_since is not None and not self._running:
            now = self._pacer.clock()
            self._held_s += now - self._held_since
            self._pacer.busy("rollout", self.device_id, self._held_since, now)
            self._held_since = None

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
        now = self._pacer.clock()
        for seq in self._running:
            if seq.finished in {"stop", "length"} and seq.due <= now:
                seq.out.finish_reason = seq.finished
                seq.cache = None
                if not seq.future.done():
                    seq.future.set_result(seq.out)
            elif seq.finished != "cancelled":
                still.append(seq)
        self._running = still
        self._note_idle()


def release_device_memory(device: str | torch.device) -> bool:
    """Return a CUDA device's cached free memory to the driver; False (nothing to do) elsewhere."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    gc.collect()  # tensors kept alive only by reference cycles (the model's hooks) go first
    with torch.cuda.device(dev):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return True
