"""Where batches come from: the trajectory service's PullBatch stream (gRPC), behind a small interface.

The trainer's trust boundary for data: every pulled batch is checked before the loop sees it
(`check_trainable`: array lengths, finiteness, token ids inside the model's vocabulary, positions,
tree structure, policy versions not ahead of the trainer's own). A batch that fails is *quarantined*:
its id and reason are appended to ``run_dir/trainer/quarantine.jsonl``, it is acked to the
trajectory service as dropped (``trained_at_version = -1``), counted and logged once, and
`pull` returns None as if nothing was ready — training goes on with the next batch. A quarantined
id is never pulled again, so a restart that replays its journal cannot replay it into a crash. A
stream that fails for good after some chunks came is a bad batch too (quarantined, not fatal).

Receipts: the trainer pulls with ``confirm_receipt`` and, once the loop journaled the batch, sends
`confirm_received` (AckBatch ``received``); only then does the trajectory service mark the batch
delivered, so a trainer killed mid-stream gets the batch again and trains it once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Protocol

import grpc
import torch
from prometheus_client import Counter

import gyre.rpc
from gyre.errors import InvalidArgument, Unavailable
from gyre.v1 import trajectory_pb2, trajectory_pb2_grpc
from gyre.validation import LOGPROB_SLACK
from services.trainer.batch import PackedBatch, from_chunks

log = logging.getLogger("gyre.trainer.data")

QUARANTINED = Counter("gyre_trainer_batches_quarantined_total", "Batches the trainer refused to train")
BAD_PULLS = Counter("gyre_trainer_pulls_refused_total", "PullBatch calls refused with RESOURCE_EXHAUSTED")
# trained_at_version of an AckBatch that drops the batch (trajectory.proto).
DROPPED = -1
# Seconds a PullBatch is retried while the trajectory service is unavailable (e.g. being restarted);
# CANCELLED is what a call in flight gets when the trajectory process shuts down.
UNAVAILABLE_RETRY_S = 60.0
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class BatchSource(Protocol):
    async def pull(self, current_version: int, resume_batch_id: str = "") -> PackedBatch | None: ...
    async def ack(self, batch_id: str, version: int) -> None: ...


class PartSource(BatchSource, Protocol):
    """A source that can also hand out a step in parts (trainer.streaming)."""

    async def pull_part(
        self, current_version: int, max_tokens: int, step_tokens: int, wait_s: float
    ) -> PackedBatch | None:
        """One part of a streamed step: a batch of whole trees of at least one scored group within
        `max_tokens`, packed without waiting for a full batch; `step_tokens` (> 0 after the step's
        first part) makes the budget strict. None when nothing came within `wait_s`, or at once
        when the step is full (PullBatchRequest.step_tokens)."""
        ...


def check_trainable(batch: PackedBatch, vocab_size: int | None, current_version: int | None) -> None:
    """InvalidArgument naming the first reason `batch` cannot be trained (module docstring)."""
    where = f"batch {batch.batch_id}"
    n = batch.num_tokens
    if n == 0:
        raise InvalidArgument(f"{where}: no tokens")
    ids = batch.token_ids
    if int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size):
        bad = int(ids.max()) if vocab_size is not None and int(ids.max()) >= vocab_size else int(ids.min())
        raise InvalidArgument(f"{where}: token id {bad} outside the model's vocabulary [0, {vocab_size})")
    if int(batch.position_ids.min()) < 0:
        raise InvalidArgument(f"{where}: negative position id")
    if float(batch.behaviour_logprobs.max()) > LOGPROB_SLACK:
        raise InvalidArgument(f"{where}: behaviour log-probs above 0")
    versions = batch.policy_versions[batch.loss_mask]  # tokens not trained carry -1
    if len(versions) and (
        int(versions.min()) < 0 or (current_version is not None and int(versions.max()) > current_version)
    ):
        raise InvalidArgument(
            f"{where}: policy versions in [{int(versions.min())}, {int(versions.max())}], outside [0, "
            f"{current_version}] (the trainer's newest published version)"
        )
    offsets = torch.tensor(batch.node_offsets, dtype=torch.long)
    lengths = torch.tensor(batch.node_lengths, dtype=torch.long)
    parents = torch.tensor(batch.node_parents, dtype=torch.long)
    if len(offsets) == 0 or int(lengths.sum()) != n:
        raise InvalidArgument(f"{where}: node lengths sum to {int(lengths.sum())}, not the {n} tokens")
    if int(lengths.min()) < 0 or int(offsets.min()) < 0 or int((offsets + lengths).max()) > n:
        raise InvalidArgument(f"{where}: a node lies outside the batch's tokens")
    if bool((parents >= torch.arange(len(parents))).any()) or int(parents.min()) < -1:
        raise InvalidArgument(f"{where}: a node's parent does not come before it")


class TrajectoryBatchSource:
    """Trajectory -> Trainer over gRPC: `PullBatch` (server stream of a batch's chunks, a large tree in
    several), `AckBatch` (receipt, then trained or dropped).

    `vocab_size` (the model's) and `quarantine_path` turn on the checks and the persistent
    quarantine of the module docstring; without a path the quarantine lasts for this process."""

    def __init__(
        self,
        address: str,
        run_id: str,
        consumer: str,
        max_tokens: int,
        wait_s: float,
        *,
        vocab_size: int | None = None,
        quarantine_path: Path | None = None,
    ) -> None:
        self.channel = gyre.rpc.channel(address)
        self.stub = trajectory_pb2_grpc.TrajectoryStub(self.channel)
        self.run_id, self.consumer, self.max_tokens, self.wait_s = run_id, consumer, max_tokens, wait_s
        self.vocab_size = vocab_size
        self.quarantine_path = quarantine_path
        # batch_id -> why it was quarantined (this run, read back from quarantine_path at start).
        self.quarantined: dict[str, str] = self._read_quarantine()

    def _read_quarantine(self) -> dict[str, str]:
        if self.quarantine_path is None or not self.quarantine_path.is_file():
            return {}
        out: dict[str, str] = {}
        for line in self.quarantine_path.read_text().splitlines():
            try:
                rec = json.loads(line)
                out[str(rec["batch_id"])] = str(rec["reason"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line after a crash: that batch is simply checked again
        return out

    async def pull(self, current_version: int, resume_batch_id: str = "") -> PackedBatch | None:
        """The next batch (or the named one, after a crash); None when nothing trainable was ready
        within wait_s (a quarantined batch counts as nothing)."""
        if resume_batch_id and resume_batch_id in self.quarantined:
            return None
        req = trajectory_pb2.PullBatchRequest(
            run_id=self.run_id,
            max_tokens=self.max_tokens,
            wait_s=self.wait_s,
            resume_batch_id=resume_batch_id,
            consumer=self.consumer,
            current_version=current_version,
            confirm_receipt=True,
        )
        return await self._pull(req)

    async def pull_part(
        self, current_version: int, max_tokens: int, step_tokens: int, wait_s: float
    ) -> PackedBatch | None:
        """One part of a streamed step (PartSource.pull_part); checked and quarantined like a batch."""
        req = trajectory_pb2.PullBatchRequest(
            run_id=self.run_id,
            max_tokens=max_tokens,
            wait_s=wait_s,
            consumer=self.consumer,
            current_version=current_version,
            stream_part=True,
            step_tokens=step_tokens,
            confirm_receipt=True,
        )
        return await self._pull(req)

    async def _pull(self, req: trajectory_pb2.PullBatchRequest) -> PackedBatch | None:
        resume_batch_id, current_version = req.resume_batch_id, req.current_version
        # The trajectory service may be restarting (supervised): the same request is retried with
        # backoff for up to UNAVAILABLE_RETRY_S before the error takes the trainer down.
        deadline, delay_s = time.monotonic() + UNAVAILABLE_RETRY_S, 0.5
        while True:
            chunks = []
            try:
                async for chunk in self.stub.PullBatch(req):
                    chunks.append(chunk)
                    if chunk.last:
                        break
                break
            except grpc.aio.AioRpcError as exc:
                if resume_batch_id and exc.code() in (
                    grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.PERMISSION_DENIED,
                ):
                    log.warning("batch %s cannot be resumed (%s): skipped", resume_batch_id, exc.details())
                    return None  # not this trainer's to replay (another consumer's, or never built)
                if exc.code() not in RETRYABLE:
                    if chunks:  # a batch that cannot arrive whole is a bad batch, not a fatal error
                        reason = f"stream failed: {exc.code().name}: {exc.details()}"
                        await self.quarantine(chunks[0].batch_id, reason)
                        return None
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        BAD_PULLS.inc()
                        log.error("PullBatch refused (%s): no batch this time", exc.details())
                        return None
                    raise
                if time.monotonic() > deadline:
                    raise Unavailable(f"trajectory service: {exc.details()}") from exc
                log.warning(
                    "trajectory unavailable (%s); retrying PullBatch in %.1f s", exc.details(), delay_s
                )
                if chunks and not req.resume_batch_id:  # a batch handed to us arrived in part: ask for it
                    req.resume_batch_id = chunks[0].batch_id
                await asyncio.sleep(delay_s)
                delay_s = min(5.0, delay_s * 2)
        if not chunks:
            return None
        batch_id = chunks[0].batch_id
        if batch_id in self.quarantined:
            return None
        try:
            batch = from_chunks(chunks)
            check_trainable(batch, self.vocab_size, current_version)
        except InvalidArgument as exc:
            await self.quarantine(batch_id, str(exc))
            return None
        return batch

    async def quarantine(self, batch_id: str, reason: str) -> None:
        """Never train `batch_id`: record it (file first, so a crash right after still knows), ack it
        to the trajectory service as dropped, count and log it."""
        self.quarantined[batch_id] = reason
        QUARANTINED.inc()
        log.error("batch %s quarantined, not trained: %s", batch_id, reason)
        if self.quarantine_path is not None:
            self.quarantine_path.parent.mkdir(parents=True, exist_ok=True)
            with self.quarantine_path.open("a") as f:
                f.write(json.dumps({"batch_id": batch_id, "reason": reason, "unix_s": time.time()}) + "\n")
        try:
            await self.ack(batch_id, DROPPED)
        except grpc.aio.AioRpcError as exc:  # the local record already keeps it out of training
            log.warning("could not ack quarantined batch %s as dropped: %s", batch_id, exc.details())

    async def confirm_received(self, batch_id: str) -> None:
        """Tell the trajectory service this trainer holds every chunk of `batch_id` (and journaled it):
        only now is the batch delivered (PullBatchRequest.confirm_receipt). Retried while the service
        is unavailable; it must succeed before the batch is trained, or a lost confirmation could
        let the batch be handed out again."""
        deadline, delay_s = time.monotonic() + UNAVAILABLE_RETRY_S, 0.5
        req = trajectory_pb2.AckBatchRequest(batch_id=batch_id, consumer=self.consumer, received=True)
        while True:
            try:
                await self.stub.AckBatch(req)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE or time.monotonic() > deadline:
                    raise
                log.warning(
                    "trajectory unavailable (%s); retrying the receipt of %s", exc.details(), batch_id
                )
                await asyncio.sleep(delay_s)
                delay_s = min(5.0, delay_s * 2)

    async def ack(self, batch_id: str, version: int) -> None:
        await self.stub.AckBatch(
            trajectory_pb2.AckBatchRequest(
                batch_id=batch_id, consumer=self.consumer, trained_at_version=version
            )
        )

    async def close(self) -> None:
        await self.channel.close()
