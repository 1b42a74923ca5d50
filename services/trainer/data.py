"""Where batches come from: the trajectory service's PullBatch stream (gRPC), behind a small interface."""

from __future__ import annotations

from typing import Protocol

import grpc

import gyre.rpc
from gyre.errors import Unavailable
from gyre.v1 import trajectory_pb2, trajectory_pb2_grpc
from services.trainer.batch import PackedBatch, from_chunks


class BatchSource(Protocol):
    async def pull(self, current_version: int, resume_batch_id: str = "") -> PackedBatch | None: ...
    async def ack(self, batch_id: str, version: int) -> None: ...


class TrajectoryBatchSource:
    """Trajectory -> Trainer over gRPC: `PullBatch` (server stream of chunks of whole trees), `AckBatch`."""

    def __init__(self, address: str, run_id: str, consumer: str, max_tokens: int, wait_s: float) -> None:
        self.channel = gyre.rpc.channel(address)
        self.stub = trajectory_pb2_grpc.TrajectoryStub(self.channel)
        self.run_id, self.consumer, self.max_tokens, self.wait_s = run_id, consumer, max_tokens, wait_s

    async def pull(self, current_version: int, resume_batch_id: str = "") -> PackedBatch | None:
        """The next batch (or the named one, after a crash); None when nothing was ready within wait_s."""
        req = trajectory_pb2.PullBatchRequest(
            run_id=self.run_id,
            max_tokens=self.max_tokens,
            wait_s=self.wait_s,
            resume_batch_id=resume_batch_id,
            consumer=self.consumer,
            current_version=current_version,
        )
        chunks = []
        try:
            async for chunk in self.stub.PullBatch(req):
                chunks.append(chunk)
                if chunk.last:
                    break
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Unavailable(f"trajectory service: {exc.details()}") from exc
            raise
        return from_chunks(chunks) if chunks else None

    async def ack(self, batch_id: str, version: int) -> None:
        await self.stub.AckBatch(
            trajectory_pb2.AckBatchRequest(
                batch_id=batch_id, consumer=self.consumer, trained_at_version=version
            )
        )

    async def close(self) -> None:
        await self.channel.close()
