"""Elastic data parallelism: a run that goes 1 -> 2 -> 1 ranks (worker processes, gloo, CPU).

The batch source is an in-memory list (the outermost edge: it stands in for the trajectory
service, which test_loop.py covers over gRPC). Both trainers train in float64 so the comparison
with a single-process trainer measures the data-parallel step, not float32 rounding.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from services.trainer.batch import PackedBatch
from services.trainer.config import TrainerConfig
from services.trainer.elastic import ElasticGroup, combine_metrics
from services.trainer.loop import Trainer
from tests.trainer.helpers import random_batch

NUM_STEPS = 6
SIZES = [1, 1, 2, 2, 1, 1]  # data-parallel size requested before each step


class ListSource:
    """Serves prepared batches in order (a stand-in for the trajectory service)."""

    def __init__(self, batches: list[PackedBatch]) -> None:
        self.batches = list(batches)
        self.acked: list[str] = []

    async def pull(self, current_version: int, resume_batch_id: str = "") -> PackedBatch | None:
        return self.batches.pop(0) if self.batches else None

    async def ack(self, batch_id: str, version: int) -> None:
        self.acked.append(batch_id)


def _batches() -> list[PackedBatch]:
    # several trees per batch, so both ranks of a 2-rank step get a non-empty shard
    return [random_batch(100 + i, num_nodes=12, batch_id=f"b{i}", num_roots=4) for i in range(NUM_STEPS)]


def _trainer(run_dir, metrics: list[dict[str, float]]) -> Trainer:
    cfg = TrainerConfig(dtype="float64", lr=1e-2, grad_clip=1.0, checkpoint_every=100, pull_wait_s=0)

    async def sink(weights, step_metrics):
        metrics.append(step_metrics)

    return Trainer(cfg, run_dir, ListSource(_batches()), sink, seed=0)


@pytest.mark.integration
@pytest.mark.timeout(240)
async def test_run_grows_and_shrinks_with_the_loss_of_one_process_and_identical_replicas(tmp_path):
    reference_metrics: list[dict[str, float]] = []
    reference = _trainer(tmp_path / "ref", reference_metrics)
    await reference.run(max_steps=NUM_STEPS)

    metrics: list[dict[str, float]] = []
    elastic = _trainer(tmp_path / "elastic", metrics)
    worker_pids: list[int] = []
    try:
        for step, size in enumerate(SIZES, start=1):
            elastic.request_dp_size(size)
            if size > elastic.dp.size:  # grow deterministically at this boundary: wait for the worker
                async with elastic.step_lock:
                    assert await asyncio.to_thread(elastic.apply_dp_size, True)
                assert isinstance(elastic.dp, ElasticGroup)
                worker_pids = elastic.dp.worker_pids()
            await elastic.run(max_steps=step)  # a shrink is applied by the loop at this step's boundary
            assert elastic.dp.size == size
            if isinstance(elastic.dp, ElasticGroup):
                digests = await asyncio.to_thread(elastic.dp.replica_digests)
                assert len(digests) == size and len(set(digests)) == 1, f"replicas differ after step {step}"
        assert isinstance(elastic.dp, ElasticGroup)
        assert elastic.dp.generation == 2  # one group for the growth, one for the shrink
        assert worker_pids and elastic.dp.worker_pids() == []
        assert not any(_running(pid) for pid in worker_pids)  # the worker exited before the shrink returned
    finally:
        await asyncio.to_thread(elastic.close)

    assert [m["dp_size"] for m in metrics] == SIZES
    assert len(reference_metrics) == NUM_STEPS
    for step, (got, want) in enumerate(zip(metrics, reference_metrics, strict=True), start=1):
        for key in ("loss", "num_tokens", "num_trained_tokens", "grad_norm", "ratio_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), f"{key} at step {step}"
    for a, b in zip(elastic.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_shard_metrics_combine_into_batch_metrics():
    parts = [
        {"loss": 1.5, "num_tokens": 10.0, "num_trained_tokens": 4.0, "ratio_mean": 1.0, "grad_norm": 0.3},
        {"loss": -0.5, "num_tokens": 6.0, "num_trained_tokens": 2.0, "ratio_mean": 0.7, "grad_norm": 0.3},
        {"loss": 0.0, "num_tokens": 0.0, "num_trained_tokens": 0.0},  # an empty shard
    ]
    out = combine_metrics(parts)
    assert out["loss"] == pytest.approx(1.0)
    assert out["num_tokens"] == 16.0 and out["num_trained_tokens"] == 6.0
    assert out["ratio_mean"] == pytest.approx((1.0 * 4 + 0.7 * 2) / 6)
    assert out["grad_norm"] == 0.3
