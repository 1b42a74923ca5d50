"""The data-parallel group meets at a c10d store whose address comes from the config or torchrun's env."""

from __future__ import annotations

import asyncio
import socket

import pytest

from services.trainer.config import TrainerConfig
from services.trainer.loop import Trainer
from services.trainer.rendezvous import LOCAL_HOST, store_address
from tests.trainer.helpers import random_batch


def test_the_store_address_comes_from_the_config_then_torchrun_env_then_a_local_free_port():
    env = {"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}
    assert store_address("trainer-0.gyre:29400", env) == ("trainer-0.gyre", 29400)
    assert store_address("[fd00::1]:29400", env) == ("fd00::1", 29400)
    assert store_address(None, env) == ("10.0.0.7", 29500)
    assert store_address(None, {"MASTER_ADDR": "10.0.0.7"}) == (LOCAL_HOST, 0)  # half an address: ignored
    assert store_address(None, {}) == (LOCAL_HOST, 0)


def test_a_malformed_rendezvous_address_is_refused_at_config_load():
    with pytest.raises(ValueError):
        TrainerConfig(rendezvous="no-port")
    assert TrainerConfig(rendezvous="10.1.2.3:29500").rendezvous == "10.1.2.3:29500"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCAL_HOST, 0))
        return int(s.getsockname()[1])


class OneBatch:
    def __init__(self) -> None:
        self.batches = [random_batch(11, num_nodes=16, num_roots=4)]

    async def pull(self, current_version: int, resume_batch_id: str = ""):
        return self.batches.pop(0) if self.batches else None

    async def ack(self, batch_id: str, version: int) -> None:
        pass


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_two_ranks_meet_at_the_store_named_by_master_addr_and_master_port(tmp_path, monkeypatch):
    port = _free_port()
    monkeypatch.setenv("MASTER_ADDR", LOCAL_HOST)
    monkeypatch.setenv("MASTER_PORT", str(port))
    metrics: list[dict[str, float]] = []

    async def sink(weights, step_metrics):
        metrics.append(step_metrics)

    cfg = TrainerConfig(device="cpu", checkpoint_every=100, pull_wait_s=0, micro_batch_tokens=1000)
    trainer = Trainer(cfg, tmp_path, OneBatch(), sink, seed=0)
    try:
        trainer.set_devices(["d0", "d1"])
        await asyncio.to_thread(trainer.dp.apply, True)
        assert trainer.dp.size == 2
        assert trainer.dp.store.port == port, "rank 0 hosts the store at MASTER_PORT"
        await trainer.run(max_steps=1)
    finally:
        await asyncio.to_thread(trainer.close)
    assert len(metrics) == 1 and metrics[0]["dp_size_min"] == 2
