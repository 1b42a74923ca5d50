"""Checkpoints of a bf16-master, ZeRO-1 trainer in torch.distributed.checkpoint format, re-sharded on restore.

Trainer A trains a step on two ranks and checkpoints: each rank writes its own DCP shard (disjoint
keys). Trainer B restarts from that checkpoint as one rank: it holds A's whole optimizer state and
parameters bit for bit, and checkpoints again as one rank (one shard). Trainer C restarts from B's
checkpoint and grows to two ranks: the state is cut into the same shards A had, equal bit for bit.
The journal and the exactly-once bookkeeping are those of every checkpoint (test_loop.py).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.distributed.checkpoint as dcp

from services.trainer.batch import PackedBatch
from services.trainer.config import TrainerConfig
from services.trainer.loop import Trainer
from services.trainer.sharded_optimizer import MasterAdamW
from tests.trainer.helpers import random_batch


class ListSource:
    def __init__(self, batches: list[PackedBatch]) -> None:
        self.batches = list(batches)

    async def pull(self, current_version: int, resume_batch_id: str = "") -> PackedBatch | None:
        return self.batches.pop(0) if self.batches else None

    async def ack(self, batch_id: str, version: int) -> None:
        pass


def _trainer(run_dir, batches: list[PackedBatch]) -> Trainer:
    cfg = TrainerConfig(
        device="cpu",
        precision="bf16",
        optimizer_sharding="zero1",
        lr=1e-2,
        checkpoint_every=1,
        pull_wait_s=0,
        micro_batch_tokens=60,
    )

    async def sink(weights, metrics):
        pass

    return Trainer(cfg, run_dir, ListSource(batches), sink, seed=0)


def _whole_state(trainer: Trainer) -> dict[tuple[int, str], torch.Tensor]:
    trainer.dp.gather_optimizer()
    try:
        assert isinstance(trainer.optimizer, MasterAdamW)
        return {(i, k): v.clone() for i, e in trainer.optimizer.entries().items() for k, v in e.items()}
    finally:
        trainer.dp.release_optimizer()


def _assert_same(a: dict[tuple[int, str], torch.Tensor], b: dict[tuple[int, str], torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
async def test_a_checkpoint_saved_by_two_sharded_ranks_restores_on_one_and_regrows_to_two(tmp_path):
    a = _trainer(tmp_path, [random_batch(400, num_nodes=24, batch_id="b0", num_roots=8)])
    try:
        a.set_devices(["d0", "d1"])
        await asyncio.to_thread(a.dp.apply, True)
        await a.run(max_steps=1)
        assert a.dp.size == 2
        a_bytes = await asyncio.to_thread(a.dp.state_bytes)
        a_state = _whole_state(a)
        a_params = [p.detach().clone() for p in a.model.parameters()]
    finally:
        await asyncio.to_thread(a.close)
    (saved,) = a.store.list()
    shards = sorted((saved / "optimizer").glob("rank-*"))
    assert [s.name for s in shards] == ["rank-00000", "rank-00001"]
    keys = [set(dcp.FileSystemReader(str(s)).read_metadata().state_dict_metadata) for s in shards]
    assert keys[0] and keys[1] and not keys[0] & keys[1], "each rank wrote its own, disjoint shard"
    assert a_bytes[0] < sum(a_bytes) and a_bytes[1] < sum(a_bytes)

    b = _trainer(tmp_path, [])  # restarts from A's checkpoint, alone
    assert b.state.step == 1 and b.dp.size == 1
    for x, y in zip(a_params, b.model.parameters(), strict=True):
        assert torch.equal(x, y)
    _assert_same(a_state, _whole_state(b))
    b.save_checkpoint()  # one rank: one shard holding everything
    b.close()
    (resaved,) = b.store.list()
    assert [s.name for s in (resaved / "optimizer").glob("rank-*")] == ["rank-00000"]

    c = _trainer(tmp_path, [])
    try:
        c.set_devices(["d0", "d1"])
        await asyncio.to_thread(c.dp.apply, True)
        assert c.dp.size == 2
        assert await asyncio.to_thread(c.dp.state_bytes) == a_bytes, "the same shards as the group that saved"
        assert len(set(await asyncio.to_thread(c.dp.replica_digests))) == 1
        _assert_same(a_state, _whole_state(c))
    finally:
        await asyncio.to_thread(c.close)
