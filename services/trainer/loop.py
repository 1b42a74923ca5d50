"""The trainer's step loop: micro-batches, streamed parts, data parallelism over the TRAIN devices held.

    restore (checkpoint + journal) -> ack what the checkpoint covers
    loop:  [boundary] pull the step's batch (replayed ids first) -> journal it
           for each part of the step (one part: the batch; trainer.streaming: parts as groups are scored):
               streaming: start pulling the next part (budget left, strict) -> journal it when it comes
               for each micro-batch of the part (whole trees, <= micro_batch_tokens):
                   [boundary] -> shard over the ranks -> backward (gradients accumulate) -> all-reduce
           clip + optimizer step on every rank -> publish weight version (prune old ones) -> every N
           steps: checkpoint
    [boundary] = the data-parallel group follows the devices held (services.trainer.dp_group):
                 ranks leave or join here, and with no device held the loop waits here.

Without streaming (the default) the whole batch is pulled first and then cut into micro-batches.
With `trainer.streaming` a step starts from its first *part* — a batch of at least one scored
group that the trajectory service packs as soon as it is scored (PullBatchRequest.stream_part) —
and, while a part trains, pulls the next one within what is left of `batch_max_tokens`; the step
takes its optimizer step when the budget is full (the trajectory service says so at once) or no
part came within `stream_wait_s`. Each part is a batch of the trajectory service: journaled when
pulled, recorded as trained with its step, acked once a checkpoint covers it — so exactly-once and
crash recovery are those of batches. `StepNormaliser` re-normalises the parts so that the step's
loss and gradient equal those of one batch of the same groups. Devices lent or taken back mid-step
are used or given up at the next micro-batch boundary, and the step is exact across the resize
(dp_group.py; tests/trainer/test_streaming.py checks both together in float64). Standalone (no
scheduler: `devices` never set) the loop trains on one rank.

Waits on: the devices (none held: no pull, no training), PullBatch (up to `pull_wait_s` when no
scored groups are ready — back-pressure from the trajectory service; streaming: up to
`stream_wait_s` for a next part, overlapped with training), the weights event's JetStream ack.
Guarantee: the model in the newest checkpoint has trained every acked batch exactly once (see
checkpoint.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from gyre.errors import InvalidArgument
from gyre.model import save_weights
from gyre.pacing import Pacer
from gyre.v1 import common_pb2
from services.trainer.batch import PackedBatch
from services.trainer.checkpoint import CheckpointStore, Journal, TrainState
from services.trainer.config import TrainerConfig
from services.trainer.data import BatchSource, PartSource
from services.trainer.dp_group import ReplicaSpec, ResizableDPGroup
from services.trainer.rendezvous import store_address
from services.trainer.sharded_optimizer import MasterAdamW
from services.trainer.step import (
    DTYPES,
    backward_micro,
    begin_step,
    build_replica,
    combine_metrics,
    finish_step,
    shard_loss_settings,
    step_batch,
)
from services.trainer.tp_mirror import load_mirror, mirror_state
from services.trainer.tp_replica import TensorParallelReplicas
from services.trainer.weights_store import prune_versions, version_path

WeightsSink = Callable[[common_pb2.WeightVersion, dict[str, float]], Awaitable[None]]


class StepAbandoned(Exception):
    """The trainer stopped mid-step while holding no device; the batch is replayed on restart."""


class Trainer:
    def __init__(
        self, cfg: TrainerConfig, run_dir: Path, source: BatchSource, publish: WeightsSink, seed: int = 0
    ) -> None:
        self.cfg, self.run_dir, self.source, self.publish_sink = cfg, Path(run_dir), source, publish
        if cfg.streaming and not callable(getattr(source, "pull_part", None)):
            raise InvalidArgument(
                f"trainer.streaming needs a batch source that hands out parts (pull_part); {source!r} "
                "does not: set trainer.streaming to false or use the trajectory service's source"
            )
        self.model, self.optimizer, self.ref_model, self.loss_settings = build_replica(
            cfg, device=torch_device(cfg.device, None), seed=seed
        )
        # Batch advantage normalisation is applied to the whole step before it is cut (train_step);
        # the shards, here and on the other ranks (shard_loss_settings), must not divide again.
        self.normalise_step = self.loss_settings.normalise_advantages
        self.loss_settings = shard_loss_settings(self.loss_settings)
        self.store = CheckpointStore(self.run_dir, keep=cfg.keep_checkpoints)
        self.device_index: dict[str, int] = {}  # leased device -> its index on its node (cuda:N)
        # TP x CP > 1: the step runs in replicas of TP x CP processes; self.model is their mirror
        # (tp_mirror.py)
        self.tp: TensorParallelReplicas | None = None
        self.dp: ResizableDPGroup | TensorParallelReplicas
        replica_size = cfg.tensor_parallel_size * cfg.context_parallel_size
        if replica_size > 1:
            self.dp = self.tp = TensorParallelReplicas(
                cfg,
                cfg.tensor_parallel_size,
                lambda: mirror_state(self.model, self.optimizer, self.ref_model),
                lambda state: load_mirror(self.model, self.optimizer, state, grads=True),
                rendezvous=store_address(cfg.rendezvous),
                cp_size=cfg.context_parallel_size,
            )
            self.dp.request_devices([f"{STANDALONE_DEVICE}{i}" for i in range(replica_size)])
        else:
            self.dp = ResizableDPGroup(
                self.model,
                self.optimizer,
                self.ref_model,
                self.replica_spec,
                self.move_rank0,
                rendezvous=store_address(cfg.rendezvous),
            )
            self.dp.request_devices([STANDALONE_DEVICE])
            self.dp.apply()
        self.stopping = False
        self.step_lock = asyncio.Lock()
        self.boundary = asyncio.Condition()  # notified after every boundary
        self.parked = False  # waiting at a boundary for a device
        # What the loop is doing now, for the watchdog: (loop, what, since unix s); None: not looping.
        self.phase: tuple[str, str, float] | None = None
        self.looping = False  # run() is active (it applies device changes at its boundaries)
        self.boundary_hooks: list[Callable[[], Awaitable[None]]] = []  # awaited at every boundary
        self.step_in_progress = False
        self.micro_left = 0  # micro-batches of the current part (the whole batch unstreamed) not trained yet
        self.step_parts = 0  # parts of the current step begun so far (1 without streaming)
        self.micro_device_s = 0.0  # measured device-seconds of the last micro-batch
        self.busy_device_s = 0.0  # device-seconds of every micro-batch trained so far (WorkerLoad)
        self.last_metrics: dict[str, float] = {}
        # perf_counter at the last optimizer step's end (at first: when this loop was built), so that
        # `step_interval_s` is the trainer's cadence, waits for scored work included (WorkerLoad.trainer_step_s)
        self.last_step_end = time.perf_counter()
        self.last_batch_groups = 0  # scored groups in the last batch pulled
        self.latest_weights = common_pb2.WeightVersion()
        self.pacer = Pacer()  # paced devices (devices.pacing): set by the service; off = no wait
        self.state = self.store.load_latest(self.model, self.optimizer) or TrainState()
        self.journal = self.store.read_journal()
        self.journal.last_published_version = max(self.journal.last_published_version, self.state.version)
        trained = set(self.state.trained_batch_ids)
        self.replay = [b for b in self.journal.pulled_batch_ids if b not in trained]

    # -- devices ------------------------------------------------------------------------------------
    def set_devices(self, device_ids: list[str]) -> None:
        """Train on exactly these leased devices (one rank each); applied at the next boundary.
        An empty list parks the loop at its next boundary (it trains nothing until a device comes)."""
        self.dp.request_devices(sorted(device_ids))

    async def wait_devices_applied(self) -> None:
        """Return once the group's ranks are the devices last set (a released device is free)."""
        async with self.boundary:
            await self.boundary.wait_for(
                lambda: not self.looping or set(self.dp.device_ids) <= set(self.dp.wanted)
            )
        if not self.looping and not self.dp.settled():  # no loop to reach a boundary: apply here
            await asyncio.to_thread(self.dp.apply)

    async def at_boundary(self) -> None:
        """A micro-batch boundary: apply the devices held; with none, wait (never train)."""
        for hook in self.boundary_hooks:
            await hook()
        while True:
            if not self.dp.settled():  # TP replicas boot in the background: wait when none trains
                await asyncio.to_thread(self.dp.apply, self.tp is not None and self.dp.size == 0)
            async with self.boundary:
                self.parked = self.dp.size == 0
                self.boundary.notify_all()
                if not self.parked or self.stopping:
                    return
                if not self.dp.settled():  # devices set while apply ran (its wake came too early)
                    continue
                await self.boundary.wait()  # set_devices or stop notifies

    async def wake(self) -> None:
        """Tell a loop parked at a boundary to look at its devices again."""
        async with self.boundary:
            self.boundary.notify_all()

    def replica_spec(self, device_id: str) -> ReplicaSpec:
        device = torch_device(self.cfg.device, self.device_index.get(device_id))
        return ReplicaSpec(
            self.cfg.model_dump_json(), device=device, backend="nccl" if device.startswith("cuda") else "gloo"
        )

    def move_rank0(self, device_id: str | None) -> None:
        """Rank 0's replica onto the device of `device_id` (None: the CPU, holding no device)."""
        target = torch.device(
            "cpu" if device_id is None else torch_device(self.cfg.device, self.device_index.get(device_id))
        )
        if next(self.model.parameters()).device == target:
            return
        for module in (self.model, self.ref_model):
            if module is not None:
                module.to(target)
        if isinstance(self.optimizer, MasterAdamW):
            self.optimizer.to(target)
            return
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    state[k] = v.to(target)

    def close(self) -> None:
        """Stop the data-parallel workers (the trainer itself stays usable as one rank)."""
        self.dp.close()

    # -- the loop -----------------------------------------------------------------------------------
    async def run(self, max_steps: int = 0) -> None:
        """Train until stopped or `max_steps` optimizer steps (this call's or cfg.max_steps) are done."""
        await self.ack_covered()
        limit = max_steps or self.cfg.max_steps
        self.looping = True
        try:
            while not self.stopping and not (limit and self.state.step >= limit):
                await self.at_boundary()
                if self.stopping:
                    break
                self.phase = ("pull", f"a batch for step {self.state.step + 1} (PullBatch)", time.time())
                batch = await self.next_batch()
                if batch is None:
                    continue
                async with self.step_lock:  # SaveCheckpoint waits for the step boundary
                    self.phase = ("train", f"step {self.state.step + 1} training", time.time())
                    try:
                        metrics = await self.train_step(batch)
                    except StepAbandoned:
                        break  # not acked: the journal replays the batch after a restart
                    self.phase = ("publish", f"weights version {self.state.step} published", time.time())
                    await self.publish_weights(metrics)
                    if self.state.step % self.cfg.checkpoint_every == 0:
                        self.save_checkpoint()
                        await self.ack_covered()
        finally:
            self.looping = False
            self.phase = None
            async with self.boundary:
                self.boundary.notify_all()  # a release waiting for a boundary applies it itself

    async def next_batch(self) -> PackedBatch | None:
        """The step's batch (streaming: its first part), a replayed one first; journaled."""
        resume = self.replay.pop(0) if self.replay else ""
        if self.cfg.streaming and not resume:
            batch = await self.part_source().pull_part(
                self.journal.last_published_version, self.cfg.batch_max_tokens, 0, self.cfg.pull_wait_s
            )
        else:
            batch = await self.source.pull(self.journal.last_published_version, resume_batch_id=resume)
        batch = await self.journaled(batch)
        if batch is not None:
            self.last_batch_groups = len(set(batch.group_ids))
        return batch

    async def next_part(self, step_tokens: int) -> PackedBatch | None:
        """The streamed step's next part (journaled): a replayed one first, else one that fits what is
        left of batch_max_tokens, waiting up to stream_wait_s; None = the step is complete."""
        while self.replay:
            part = await self.source.pull(self.journal.last_published_version, self.replay.pop(0))
            if (part := await self.journaled(part)) is not None:
                return part
        left = self.cfg.batch_max_tokens - step_tokens
        if left <= 0:
            return None
        part = await self.part_source().pull_part(
            self.journal.last_published_version, left, step_tokens, self.cfg.stream_wait_s
        )
        return await self.journaled(part)

    def part_source(self) -> PartSource:
        return self.source  # type: ignore[return-value]  # checked in __init__ when streaming

    async def journaled(self, batch: PackedBatch | None) -> PackedBatch | None:
        """`batch`, its id written to the journal before it is trained and then its receipt confirmed
        to the source (the trajectory service marks it delivered only then: a trainer killed before
        gets it again, one killed after replays it from the journal); None for a redelivered batch
        this model already trained (it is acked at the next checkpoint)."""
        if batch is None:
            return None
        if (
            batch.batch_id not in self.journal.pulled_batch_ids
            and batch.batch_id not in self.state.trained_batch_ids
        ):
            self.journal.pulled_batch_ids.append(batch.batch_id)
            self.store.write_journal(self.journal)
        confirm = getattr(self.source, "confirm_received", None)  # sources without receipts: none to send
        if confirm is not None:
            await confirm(batch.batch_id)
        if batch.batch_id in self.state.trained_batch_ids:
            return None
        return batch

    async def train_step(self, batch: PackedBatch) -> dict[str, float]:
        """One optimizer step over `batch` — streaming: over `batch` and the parts pulled after it while
        it trains — micro-batch by micro-batch, resizing at each boundary."""
        start = time.perf_counter()
        self.step_in_progress = True
        begin_step(self.optimizer)
        if self.tp is not None and self.tp.size:
            self.tp.begin_step()
        shard_metrics: list[dict[str, float]] = []
        sizes: list[int] = []
        step: list[PackedBatch] = []  # the step's parts (one without streaming)
        norm = StepNormaliser(self.cfg.streaming)
        pending: asyncio.Task[PackedBatch | None] | None = None
        num_micro = 0
        recomputed = 0  # context tokens forwarded again because a tree was split across micro-batches
        step_rms: float | None = None
        part: PackedBatch | None = batch
        try:
            while part is not None:
                step.append(part)
                self.step_parts = len(step)
                if self.cfg.streaming:  # the next part is pulled while this one trains
                    pending = asyncio.create_task(self.next_part(sum(p.num_tokens for p in step)))
                grad_factor, weight_factor = norm.add(part)
                if self.normalise_step:  # one RMS for the whole step, before it is cut
                    part, step_rms = step_batch(part.to("cpu", DTYPES[self.cfg.dtype]), True)
                micro_batches = part.micro_batches(self.cfg.micro_batch_tokens)
                recomputed += sum(m.num_tokens for m in micro_batches) - part.num_tokens
                self.micro_left = len(micro_batches)
                for micro in micro_batches:
                    await self.at_boundary()
                    if self.dp.size == 0:  # stopping while no device is held: the step is abandoned
                        raise StepAbandoned(part.batch_id)
                    t0, size = time.perf_counter(), self.dp.size
                    m0 = self.pacer.clock()
                    got = await asyncio.to_thread(self._micro, micro, grad_factor, weight_factor)
                    grad_factor = 1.0  # the accumulated gradient is rescaled once per part
                    norm.add_loss(sum(m["loss"] for m in got))
                    shard_metrics += got
                    # paced: the micro-batch takes the modelled time of its share of the part's groups
                    groups = len(set(part.group_ids)) * micro.num_tokens / max(1, part.num_tokens)
                    await self.pacer.wait("train", m0, functools.partial(self.pacer.train_s, groups, size))
                    self.pacer.busy("train", "trainer", m0, self.pacer.clock(), devices=size)
                    self.micro_device_s = (time.perf_counter() - t0) * size
                    self.busy_device_s += self.micro_device_s
                    self.micro_left -= 1
                    num_micro += 1
                    sizes.append(size)
                part, pending = (await pending if pending is not None else None), None
            grad_norm = await asyncio.to_thread(self._finish)
        finally:
            if pending is not None:  # abandoned: the part pulled meanwhile is journaled (replayed later)
                await pending
            self.step_in_progress, self.micro_left, self.step_parts = False, 0, 0
        end = time.perf_counter()
        self.state.step += 1
        self.state.trained_batch_ids.extend(p.batch_id for p in step)
        self.last_batch_groups = len({g for p in step for g in p.group_ids})
        metrics = combine_metrics(shard_metrics)
        if self.cfg.streaming:
            metrics["loss"] = norm.step_loss()
        metrics.update(
            recomputed_context_tokens=float(recomputed),
            step=float(self.state.step),
            dp_size=float(self.dp.size),
            dp_size_mean=sum(sizes) / len(sizes),  # ranks per micro-batch: min < max = resized mid-step
            dp_size_min=float(min(sizes)),
            dp_size_max=float(max(sizes)),
            num_micro_batches=float(num_micro),
            num_parts=float(len(step)),
            step_s=end - start,
            step_interval_s=end - self.last_step_end,
        )
        self.last_step_end = end
        if step_rms is not None:
            metrics["advantage_rms"] = step_rms
        if self.cfg.grad_clip:
            metrics["grad_norm"] = grad_norm
        num_paths = sum(p.num_paths for p in step)
        metrics["num_paths"] = float(num_paths)
        if num_paths:
            metrics["reward_mean"] = sum(p.reward_sum for p in step) / num_paths
        self.last_metrics = metrics
        return metrics

    def _micro(
        self, micro: PackedBatch, grad_factor: float = 1.0, weight_factor: float = 1.0
    ) -> list[dict[str, float]]:
        """One micro-batch on every rank. `grad_factor` rescales rank 0's accumulated gradient first (the
        other ranks zero theirs), `weight_factor` the micro-batch's weights (StepNormaliser)."""
        param = next(self.model.parameters())
        dtype = DTYPES[self.cfg.dtype]
        if grad_factor != 1.0:
            with torch.no_grad():
                if isinstance(self.optimizer, MasterAdamW):
                    grads = self.optimizer.gradients()
                else:  # a missing gradient stays missing (a lone rank's AdamW skips it)
                    grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                for g in grads:
                    g.mul_(grad_factor)
        if weight_factor != 1.0:  # scaled in the training dtype, before the shards go out
            micro = micro.to("cpu", dtype).scaled(weight_factor)
        if self.tp is not None:
            return self.tp.micro(micro.to("cpu", dtype), grad_factor)
        assert isinstance(self.dp, ResizableDPGroup)
        shard = self.dp.scatter(micro).to(param.device, dtype)
        metrics = backward_micro(self.model, shard, self.loss_settings, self.ref_model)
        self.dp.reduce_gradients(self.model)
        return [metrics, *self.dp.gather_metrics()]

    def _finish(self) -> float:
        if self.tp is not None:  # the replicas step; the mirror takes their new weights (published
            # next); their optimizer state only when a checkpoint needs it (save_checkpoint)
            tp_norm = self.tp.finish_step()
            load_mirror(self.model, self.optimizer, self.tp.full_state(optimizer=False), grads=False)
            return tp_norm
        assert isinstance(self.dp, ResizableDPGroup)
        self.dp.finish_step()
        norm = finish_step(self.model, self.optimizer, self.cfg.grad_clip)
        self.dp.wait_finished()
        return norm

    def remaining_work_device_s(self) -> float:
        """Estimated device-seconds left in the current step (0 when none runs)."""
        return self.micro_left * self.micro_device_s if self.step_in_progress else 0.0

    async def publish_weights(self, metrics: dict[str, float]) -> None:
        """Write version v (safetensors + sha256) to run_dir/weights and announce it (rank 0 only),
        then prune the store: at most `trainer.weight_versions_kept` versions on disk after each
        publish; a version the staleness bound can still ask for is never deleted (weights_store.py)."""
        self.state.version = self.journal.last_published_version + 1
        weights_dir = self.run_dir / "weights"
        path = version_path(weights_dir, self.state.version).resolve()
        digest = save_weights(self.model, path)
        self.latest_weights = common_pb2.WeightVersion(
            version=self.state.version,
            uri=path.as_uri(),
            sha256=digest,
            train_step=self.state.step,
            created_unix_s=time.time(),
            num_bytes=path.stat().st_size,
        )
        await self.publish_sink(self.latest_weights, metrics)
        self.journal.last_published_version = self.state.version
        self.store.write_journal(self.journal)
        keep = self.cfg.weight_versions_kept
        await asyncio.to_thread(prune_versions, weights_dir, self.state.version, keep)

    def save_checkpoint(self) -> Path | None:
        """Rank 0 writes the model and state; with a MasterAdamW every rank writes its optimizer shard.
        With TP replicas the mirror first takes their optimizer state (it holds only their weights
        between checkpoints; with no replica it holds everything already, kept when the last left)."""
        if self.tp is not None and self.tp.size > 0:
            load_mirror(self.model, self.optimizer, self.tp.full_state(), grads=False)
        writer = (
            self.dp.save_optimizer
            if isinstance(self.dp, ResizableDPGroup) and isinstance(self.optimizer, MasterAdamW)
            else None
        )
        return self.store.save(self.model, self.optimizer, self.state, writer)

    async def ack_covered(self) -> None:
        """Ack every journaled batch the newest checkpoint covers, then forget it."""
        saved = self.store.list()
        covered = (
            set(json.loads((saved[-1] / "state.json").read_text())["trained_batch_ids"]) if saved else set()
        )
        done = [b for b in self.journal.pulled_batch_ids if b in covered]
        for batch_id in done:
            await self.source.ack(batch_id, self.state.version)
        if done:
            self.journal = Journal(
                [b for b in self.journal.pulled_batch_ids if b not in covered],
                self.journal.last_published_version,
            )
            self.store.write_journal(self.journal)


class StepNormaliser:
    """Makes a step trained from parts equal to one batch of the same groups (trainer.streaming).

    The trajectory service normalises each batch's weights by that batch's own normaliser N_i
    (trained tokens counted per member; BatchChunk.normaliser), and N adds up over disjoint groups, so
    the step's batch would carry weights w_i * N_i / N with N = N_1 + ... + N_k, known only once the
    last part arrived. The loss is linear in the weights, so after part i the gradient accumulated
    so far is kept normalised by C_i = N_1 + ... + N_i: part i's weights are multiplied by N_i / C_i,
    and the gradient accumulated before it (rank 0's: the other ranks zero theirs per micro-batch)
    by C_{i-1} / C_i. After the last part the gradient is exactly the step batch's; clipping and the
    optimizer step see it unchanged. The step's loss is sum_i loss_i * C_i / N. A part without a
    normaliser (0: stored before the field existed) counts its trained tokens instead.
    Without streaming every factor is 1 and nothing is rescaled."""

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self.total = 0.0  # C_i
        self.loss_sum = 0.0  # sum of micro-batch losses, each times the C_i it was trained under

    def add(self, part: PackedBatch) -> tuple[float, float]:
        """(factor for the accumulated gradient, factor for `part`'s weights) as `part` joins the step."""
        if not self.streaming:
            return 1.0, 1.0
        n = part.normaliser if part.normaliser > 0 else float(part.loss_mask.sum()) or 1.0
        before, self.total = self.total, self.total + n
        return (before / self.total if before else 1.0), n / self.total

    def add_loss(self, loss: float) -> None:
        self.loss_sum += loss * (self.total if self.streaming else 1.0)

    def step_loss(self) -> float:
        return self.loss_sum / (self.total if self.streaming and self.total else 1.0)


STANDALONE_DEVICE = "local"  # the one rank of a trainer without a scheduler


def torch_device(kind: str, index: int | None) -> str:
    """The torch device of a leased device: `cpu` slots are logical (every rank on the CPU);
    `cuda` maps the device's index on its node to cuda:N; `auto` is cuda when available."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return "cpu"
    return f"cuda:{index or 0}"
