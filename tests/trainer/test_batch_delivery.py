"""A batch reaches the trainer in bounded chunks and is delivered only when the trainer has all of it:
against the real trajectory service (real NATS, Postgres and gRPC) and a trainer process killed
mid-stream. The batch stays ``ready`` while unconfirmed, is handed out again (same id, same chunks)
to the restarted trainer, trained once and acked."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gyre.v1 import trajectory_pb2
from services.trainer.batch import from_chunks
from services.trainer.config import TrainerConfig
from services.trainer.data import TrajectoryBatchSource
from services.trainer.loop import Trainer
from tests.trainer.test_streaming_service import Trajectory, _groups

pytestmark = pytest.mark.integration

CHUNK_BYTES = 4096  # the smallest chunk the service allows: a group's tree takes several

KILLED_TRAINER = textwrap.dedent(
    """
    import asyncio, os, sys
    from gyre import rpc
    from gyre.v1 import trajectory_pb2, trajectory_pb2_grpc

    async def main():
        stub = trajectory_pb2_grpc.TrajectoryStub(rpc.channel(sys.argv[1]))
        req = trajectory_pb2.PullBatchRequest(
            run_id=sys.argv[2], consumer="trainer-0", wait_s=30.0, confirm_receipt=True
        )
        seen = 0
        async for chunk in stub.PullBatch(req):
            seen += 1
            if seen == 2:
                print(chunk.batch_id, flush=True)
                os._exit(9)  # killed mid-stream: no receipt, no clean close

    asyncio.run(main())
    """
)


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_trainer_killed_mid_stream_gets_the_batch_again_and_trains_it_once(
    nats_url, database_url, tmp_path: Path
) -> None:
    run_id = f"deliver{os.getpid()}{id(tmp_path) % 10_000}"
    traj = await Trajectory().start(nats_url, database_url, run_id, max_chunk_bytes=CHUNK_BYTES)
    try:
        await traj.publish(_groups()[0])
        address = f"127.0.0.1:{traj.port}"
        killed = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", KILLED_TRAINER, address, run_id],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).parents[2],
        )
        assert killed.returncode == 9, killed.stderr
        batch_id = killed.stdout.strip()
        assert traj.batches() == {batch_id: "ready"}  # handed out, never confirmed: not delivered

        # the whole batch, as a reader sees it: several chunks, each within the bound
        chunks = [
            c
            async for c in traj.stub.PullBatch(
                trajectory_pb2.PullBatchRequest(run_id=run_id, consumer="trainer-0", confirm_receipt=True)
            )
        ]
        assert [c.batch_id for c in chunks] == [batch_id] * len(chunks) and len(chunks) > 2
        assert max(c.ByteSize() for c in chunks) <= CHUNK_BYTES
        assert any(c.tree_continues for c in chunks)  # a tree really spans chunks
        whole = from_chunks(chunks)
        assert traj.batches() == {batch_id: "ready"}  # still unconfirmed

        cfg = TrainerConfig(
            dtype="float64",
            device="cpu",
            lr=1e-2,
            checkpoint_every=1,
            pull_wait_s=10.0,
            micro_batch_tokens=256,
            trajectory_address=address,
        )
        source = TrajectoryBatchSource(address, run_id, "trainer-0", cfg.batch_max_tokens, cfg.pull_wait_s)
        metrics: list[dict[str, float]] = []

        async def sink(weights, step_metrics):  # type: ignore[no-untyped-def]
            metrics.append(step_metrics)

        trainer = Trainer(cfg, tmp_path / "trainer", source, sink, seed=0)
        await trainer.run(max_steps=1)
        assert trainer.state.trained_batch_ids == [batch_id]  # the same batch, trained once
        assert metrics[0]["num_trained_tokens"] == int(whole.loss_mask.sum())
        assert traj.batches() == {batch_id: "acked"}
        assert await traj.stat("batches_quarantined") == 0
        # nothing is handed out again
        source.wait_s = 0.3
        assert await source.pull(1) is None
        await source.close()
    finally:
        await traj.stop()
