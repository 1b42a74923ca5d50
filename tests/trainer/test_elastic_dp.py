"""Elastic data parallelism: ranks join and leave *inside* a step, at micro-batch boundaries.

One trainer follows a schedule of devices held (one rank per device: worker processes, gloo, CPU)
that changes at every micro-batch boundary — growing 1 -> 2 -> 3, giving up rank 0's own device
(rank 0 moves onto another one), holding no device at all for a while (the loop waits), and
growing again. A second trainer trains the same batches on one rank. In float64, the steps'
losses and parameter updates must agree (rtol 1e-6): gradient accumulation is exact across
every resize.

The batch source is an in-memory list (the outermost edge: it stands in for the trajectory
service, which test_loop.py covers over gRPC).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from services.trainer.batch import PackedBatch
from services.trainer.config import TrainerConfig
from services.trainer.loop import Trainer
from services.trainer.step import combine_metrics
from tests.trainer.helpers import DeviceSchedule, random_batch

NUM_STEPS = 2
MICRO_BATCH_TOKENS = 40
# devices held from the k-th boundary on (boundary 0 comes before the first pull)
SCHEDULE = [
    ["d0"],
    ["d0"],
    ["d0", "d1"],
    ["d0", "d1", "d2"],
    ["d1", "d2"],  # rank 0's device is taken: rank 0 moves onto d1, d1's worker leaves
    [],  # no device: the loop waits here, mid-step
    ["d2", "d0"],
]


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
    return [random_batch(100 + i, num_nodes=24, batch_id=f"b{i}", num_roots=8) for i in range(NUM_STEPS)]


def _trainer(run_dir, metrics: list[dict[str, float]], normalise: bool = False) -> Trainer:
    cfg = TrainerConfig(
        normalise_batch_advantages=normalise,
        dtype="float64",
        device="cpu",
        lr=1e-2,
        grad_clip=1.0,
        checkpoint_every=100,
        pull_wait_s=0,
        micro_batch_tokens=MICRO_BATCH_TOKENS,
    )

    async def sink(weights, step_metrics):
        metrics.append(step_metrics)

    return Trainer(cfg, run_dir, ListSource(_batches()), sink, seed=0)


def test_a_batch_is_cut_into_micro_batches_of_whole_trees_under_the_budget():
    batch = _batches()[0]
    micro = batch.micro_batches(MICRO_BATCH_TOKENS)
    assert len(micro) >= 3
    assert sum(m.num_tokens for m in micro) == batch.num_tokens
    assert sum(len(m.tree_ranges()) for m in micro) == len(batch.tree_ranges())
    sizes = [sum(batch.node_lengths[a:b]) for a, b in batch.tree_ranges()]
    assert all(m.num_tokens <= max(MICRO_BATCH_TOKENS, max(sizes)) for m in micro)
    assert torch.equal(torch.cat([m.token_ids for m in micro]), batch.token_ids)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("normalise", [False, True], ids=["plain", "batch-normalised advantages"])
async def test_ranks_join_and_leave_mid_step_and_the_step_equals_one_rank(tmp_path, normalise):
    reference_metrics: list[dict[str, float]] = []
    reference = _trainer(tmp_path / "ref", reference_metrics, normalise)
    await reference.run(max_steps=NUM_STEPS)
    assert [m["dp_size"] for m in reference_metrics] == [1.0] * NUM_STEPS

    metrics: list[dict[str, float]] = []
    elastic = _trainer(tmp_path / "elastic", metrics, normalise)
    seen_sizes: list[int] = []
    seen_pids: set[int] = set()

    async def check(boundary: int) -> None:
        assert sorted(elastic.dp.device_ids) == sorted(SCHEDULE[min(boundary - 1, len(SCHEDULE) - 1)])
        seen_sizes.append(elastic.dp.size)
        seen_pids.update(elastic.dp.worker_pids())
        digests = await asyncio.to_thread(elastic.dp.replica_digests)
        assert len(set(digests)) == 1, f"replicas differ at boundary {boundary}"

    schedule = DeviceSchedule(elastic, SCHEDULE, check)
    try:
        await elastic.run(max_steps=NUM_STEPS)
        assert len(set(await asyncio.to_thread(elastic.dp.replica_digests))) == 1
        final_pids, spare_pids = elastic.dp.worker_pids(), elastic.dp.spare_pids()
    finally:
        await asyncio.to_thread(elastic.close)
    assert not any(_running(pid) for pid in seen_pids), "close() left a worker process running"

    assert schedule.boundaries >= len(SCHEDULE), "the schedule did not play out: too few micro-batches"
    assert {1, 2, 3} <= set(seen_sizes)
    assert elastic.dp.generation >= 5
    # CPU slots: a leaving rank's process stays as a spare outside the group and serves the next
    # slot granted, so three devices over six resizes needed two worker processes
    assert len(seen_pids) == 2 and set(spare_pids).isdisjoint(final_pids)
    assert len(metrics) == len(reference_metrics) == NUM_STEPS
    assert metrics[0]["dp_size_min"] == 1 and metrics[0]["dp_size_max"] == 3, "step 1 grew mid-step"
    for step, (got, want) in enumerate(zip(metrics, reference_metrics, strict=True), start=1):
        for key in ("loss", "num_tokens", "num_trained_tokens", "grad_norm", "ratio_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-12), f"{key} at step {step}"
    for a, b in zip(elastic.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)
    fresh = _fresh_params(tmp_path)
    moved = [(a - b).abs().max().item() for a, b in zip(elastic.model.parameters(), fresh, strict=True)]
    assert max(moved) > 1e-4, "the steps did not change the parameters: the comparison would be vacuous"


def _fresh_params(tmp_path) -> list[torch.Tensor]:
    return [p.detach().clone() for p in _trainer(tmp_path / "fresh", []).model.parameters()]


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_shard_metrics_combine_into_batch_metrics():
    parts = [
        {"loss": 0.0, "num_tokens": 0.0, "num_trained_tokens": 0.0},  # an empty shard first
        {"loss": 1.5, "num_tokens": 10.0, "num_trained_tokens": 4.0, "ratio_mean": 1.0, "grad_norm": 0.3},
        {"loss": -0.5, "num_tokens": 6.0, "num_trained_tokens": 2.0, "ratio_mean": 0.7, "grad_norm": 0.3},
    ]
    out = combine_metrics(parts)
    assert out["loss"] == pytest.approx(1.0)
    assert out["num_tokens"] == 16.0 and out["num_trained_tokens"] == 6.0
    assert out["ratio_mean"] == pytest.approx((1.0 * 4 + 0.7 * 2) / 6)
    assert out["grad_norm"] == 0.3


async def test_a_trainer_holding_no_device_pulls_nothing_until_a_device_is_leased(tmp_path):
    from services.trainer.service import TrainDevices

    metrics: list[dict[str, float]] = []
    trainer = _trainer(tmp_path, metrics)
    devices = TrainDevices(trainer)
    devices.pool = {"cpu0-0": 0}
    trainer.set_devices([])  # a worker of the pool starts with no device
    run = asyncio.create_task(trainer.run(max_steps=1))
    async with asyncio.timeout(60), trainer.boundary:
        await trainer.boundary.wait_for(lambda: trainer.parked)
    assert len(trainer.source.batches) == NUM_STEPS and metrics == []  # parked before the first pull
    assert trainer.dp.size == 0 and not run.done()

    await devices.start_using("cpu0-0")  # the lease client acquired a TRAIN lease
    await asyncio.wait_for(run, 120)
    assert len(metrics) == 1 and metrics[0]["dp_size_min"] == 1
    await devices.stop_using("cpu0-0")  # returns once the rank has left: nothing trains on it
    assert trainer.dp.size == 0 and trainer.dp.device_ids == []
    trainer.close()


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_cpu_slot_given_back_while_its_worker_boots_keeps_the_worker_for_the_next_grant(tmp_path):
    # Colocate hands the trainer the whole pool for one step, often shorter than a worker's
    # start-up on a loaded CPU. The booting worker must survive the hand-back, or no rank but rank 0
    # would ever join.
    trainer = _trainer(tmp_path, [])
    dp = trainer.dp
    try:
        dp.request_devices(["d0", "d1"])
        dp.apply()  # d1's worker starts; not waited for
        booting = [w.process.pid for w in dp.booting]
        assert len(booting) == 1
        dp.request_devices(["d0"])  # d1 goes back to rollout before its worker is ready
        dp.apply()
        assert dp.spare_pids() == booting and _running(booting[0])
        dp.request_devices(["d0", "d2"])  # the next grant reuses that process
        dp.apply(wait=True)
        assert dp.worker_pids() == booting and dp.size == 2
        assert len(set(dp.replica_digests())) == 1
    finally:
        trainer.close()
    assert not _running(booting[0])
