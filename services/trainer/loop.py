"""The trainer's step loop.

    restore (checkpoint + journal) -> ack what the checkpoint covers
    loop:  pull batch (replayed ids first) -> journal it -> forward/backward (DP shard, grads summed)
           -> optimizer step -> publish weight version -> every N steps: checkpoint, ack covered batches
    at each step boundary: apply a pending data-parallel resize (services.trainer.elastic)

Waits on: PullBatch (up to `pull_wait_s` when no scored groups are ready — back-pressure from the
trajectory service), the weights event's JetStream ack. Guarantee: the model in the newest checkpoint
has trained every acked batch exactly once (see checkpoint.py).
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from gyre.model import build_model, save_weights
from gyre.v1 import common_pb2
from services.trainer.batch import PackedBatch
from services.trainer.checkpoint import CheckpointStore, Journal, TrainState
from services.trainer.config import TrainerConfig
from services.trainer.data import BatchSource
from services.trainer.elastic import ElasticGroup, ReplicaSpec
from services.trainer.loss import LossSettings, tree_loss

WeightsSink = Callable[[common_pb2.WeightVersion, dict[str, float]], Awaitable[None]]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class SingleProcess:
    """Data parallelism of one rank (the elastic group replaces it when devices are granted)."""

    rank, size = 0, 1

    def shard(self, batch: PackedBatch) -> PackedBatch:
        return batch

    def reduce_gradients(self, model: Any) -> None:
        return None

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return metrics


def build_replica(
    cfg: TrainerConfig, device: str | torch.device = "cpu", seed: int = 0
) -> tuple[Any, torch.optim.Optimizer, Any | None, LossSettings]:
    """Model, optimizer, reference model (with KL) and loss settings of one replica."""
    model = build_model(cfg.model, device=device, dtype=DTYPES[cfg.dtype], seed=seed)
    if cfg.init_weights:  # an HF checkpoint directory or a Gyre safetensors file
        from gyre.model.hf import load_initial_weights

        load_initial_weights(model, cfg.init_weights)
    ref_model = copy.deepcopy(model).requires_grad_(False) if cfg.kl_coef else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return model, optimizer, ref_model, LossSettings(clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef)


def train_on_shard(
    model: Any,
    optimizer: torch.optim.Optimizer,
    shard: PackedBatch,
    settings: LossSettings,
    ref_model: Any | None,
    grad_clip: float,
    reduce_gradients: Callable[[Any], None],
) -> dict[str, float]:
    """One rank's part of a step: shard loss -> backward -> gradients summed over ranks -> clip -> step."""
    model.train()
    loss, metrics = tree_loss(model, shard, settings, ref_model)
    optimizer.zero_grad(set_to_none=False)
    loss.backward()
    reduce_gradients(model)
    if grad_clip:
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    optimizer.step()
    return metrics


class Trainer:
    def __init__(
        self, cfg: TrainerConfig, run_dir: Path, source: BatchSource, publish: WeightsSink, seed: int = 0
    ) -> None:
        self.cfg, self.run_dir, self.source, self.publish_sink = cfg, Path(run_dir), source, publish
        self.model, self.optimizer, self.ref_model, self.loss_settings = build_replica(cfg, seed=seed)
        self.store = CheckpointStore(self.run_dir, keep=cfg.keep_checkpoints)
        self.dp: SingleProcess | ElasticGroup = SingleProcess()
        self.dp_target = 1
        self.stopping = False
        self.step_lock = asyncio.Lock()
        self.last_metrics: dict[str, float] = {}
        self.latest_weights = common_pb2.WeightVersion()
        self.state = self.store.load_latest(self.model, self.optimizer) or TrainState()
        self.journal = self.store.read_journal()
        self.journal.last_published_version = max(self.journal.last_published_version, self.state.version)
        trained = set(self.state.trained_batch_ids)
        self.replay = [b for b in self.journal.pulled_batch_ids if b not in trained]

    async def run(self, max_steps: int = 0) -> None:
        """Train until stopped or `max_steps` optimizer steps (this call's or cfg.max_steps) are done."""
        await self.ack_covered()
        limit = max_steps or self.cfg.max_steps
        while not self.stopping and not (limit and self.state.step >= limit):
            batch = await self.next_batch()
            if batch is None:
                continue
            async with self.step_lock:  # lease releases and SaveCheckpoint wait for the step boundary
                if self.dp_target != self.dp.size or (isinstance(self.dp, ElasticGroup) and self.dp.booting):
                    await asyncio.to_thread(self.apply_dp_size, False)
                metrics = await asyncio.to_thread(self.train_step, batch)
                await self.publish_weights(metrics)
                if self.state.step % self.cfg.checkpoint_every == 0:
                    self.save_checkpoint()
                    await self.ack_covered()

    async def next_batch(self) -> PackedBatch | None:
        resume = self.replay.pop(0) if self.replay else ""
        batch = await self.source.pull(self.journal.last_published_version, resume_batch_id=resume)
        if batch is None or batch.batch_id in self.state.trained_batch_ids:
            return None  # a redelivered batch this model already trained: skipped (acked at checkpoint)
        if batch.batch_id not in self.journal.pulled_batch_ids:
            self.journal.pulled_batch_ids.append(batch.batch_id)
            self.store.write_journal(self.journal)
        return batch

    def request_dp_size(self, size: int) -> None:
        """Ask for `size` data-parallel ranks (one per TRAIN device held, at least 1); the loop
        applies it at the next step boundary (growing: once the new workers are ready)."""
        self.dp_target = max(1, int(size))

    def apply_dp_size(self, wait: bool = False) -> bool:
        """Resize the data-parallel group toward `dp_target` now; call only at a step boundary
        (holding `step_lock`). True when the membership changed. See services.trainer.elastic."""
        if isinstance(self.dp, SingleProcess):
            if self.dp_target == 1:
                return False
            self.dp = ElasticGroup(self.model, self.optimizer, self.ref_model, self.replica_spec)
        self.dp.request_size(self.dp_target)
        return self.dp.apply(wait=wait)

    def replica_spec(self, rank: int) -> ReplicaSpec:
        device = next(self.model.parameters()).device
        on_cuda = device.type == "cuda"
        return ReplicaSpec(
            self.cfg.model_dump_json(),
            device=f"cuda:{rank}" if on_cuda else "cpu",  # untested: one local GPU per rank
            backend="nccl" if on_cuda else "gloo",
        )

    def close(self) -> None:
        """Stop the data-parallel workers (the trainer itself stays usable as one rank)."""
        if isinstance(self.dp, ElasticGroup):
            self.dp.close()
        self.dp = SingleProcess()

    def train_step(self, batch: PackedBatch) -> dict[str, float]:
        start = time.perf_counter()
        shard = self.dp.shard(batch).to(next(self.model.parameters()).device, DTYPES[self.cfg.dtype])
        metrics = train_on_shard(
            self.model,
            self.optimizer,
            shard,
            self.loss_settings,
            self.ref_model,
            self.cfg.grad_clip,
            self.dp.reduce_gradients,
        )
        self.state.step += 1
        self.state.trained_batch_ids.append(batch.batch_id)
        metrics = self.dp.reduce_metrics(metrics)
        metrics.update(
            step=float(self.state.step), dp_size=float(self.dp.size), step_s=time.perf_counter() - start
        )
        metrics["num_paths"] = float(batch.num_paths)
        if batch.num_paths:
            metrics["reward_mean"] = batch.reward_sum / batch.num_paths
        self.last_metrics = metrics
        return metrics

    async def publish_weights(self, metrics: dict[str, float]) -> None:
        """Write version v (safetensors + sha256) to run_dir/weights and announce it (rank 0 only)."""
        self.state.version = self.journal.last_published_version + 1
        if self.dp.rank == 0:
            path = (self.run_dir / "weights" / f"v{self.state.version:06d}.safetensors").resolve()
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

    def save_checkpoint(self) -> Path | None:
        if self.dp.rank != 0:
            return None
        return self.store.save(self.model, self.optimizer, self.state)

    async def ack_covered(self) -> None:
        """Ack every journaled batch the newest checkpoint covers, then forget it."""
        saved = self.store.list()
        covered = (
            set(json.loads((saved[-1] / "state.json").read_text())["trained_batch_ids"]) if saved else set()
        )
        done = [b for b in self.journal.pulled_batch_ids if b in covered]
        for batch_id in done:
            if self.dp.rank == 0:
                await self.source.ack(batch_id, self.state.version)
        if done:
            self.journal = Journal(
                [b for b in self.journal.pulled_batch_ids if b not in covered],
                self.journal.last_published_version,
            )
            self.store.write_journal(self.journal)
