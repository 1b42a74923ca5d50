"""A poisoned batch never crashes the trainer, and a restart never replays it.

Real pieces only: the trajectory service (in-process, real NATS, Postgres and gRPC) with its
vocabulary check *off*, so a poisoned group (token id 100000) reaches a batch as it could from a
misconfigured or older producer; the real Megatron trainer loop with its model's vocabulary of 512.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from gyre import rpc, store
from gyre.bus import Bus, subjects
from gyre.config import CommonConfig
from gyre.service import Runtime
from gyre.v1 import trajectory_pb2, trajectory_pb2_grpc
from services.trainer.config import TrainerConfig
from services.trainer.data import TrajectoryBatchSource
from services.trainer.loop import Trainer
from services.trajectory.config import TrajectoryConfig
from services.trajectory.service import TrajectoryService
from services.trajectory.synthetic import WorkloadConfig, end_event, generate, step_event

MIGRATIONS = Path(__file__).resolve().parents[2] / "services" / "trajectory" / "migrations"


def _workload(seed: int) -> WorkloadConfig:
    return WorkloadConfig(
        num_groups=1,
        group_size=2,
        task_prompt_tokens=32,
        num_turns=2,
        generated_tokens=8,
        observation_tokens=8,
        compaction_every=10,
        summary_tokens=4,
        retry_fraction=0.0,
        shared_early_turns=1,
        exact_duplicates_per_group=0,
        near_duplicates_per_group=0,
        seed=seed,
    )


async def _until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("condition not reached in time")


@pytest.mark.integration
async def test_a_poisoned_batch_is_quarantined_training_goes_on_and_a_restart_skips_it(
    nats_url: str, database_url: str, tmp_path: Path
) -> None:
    run_id = f"r{random.randrange(1 << 30)}"
    await asyncio.to_thread(store.upgrade, database_url, MIGRATIONS, "alembic_version_trajectory")
    engine = store.create_engine(database_url)
    bus = await Bus.connect(nats_url, name="trajectory-quarantine")
    await bus.ensure_streams()
    server, port = rpc.create_server()
    common = CommonConfig(run_id=run_id, nats_url=nats_url, database_url=database_url)
    cfg = TrajectoryConfig.model_validate({"ready_poll_s": 0.1, "batch_max_wait_s": 0.0, "vocab_size": None})
    service = TrajectoryService(common, cfg)
    await service.start(
        Runtime(common=common, bus=bus, engine=engine, server=server, port=port, name="trajectory")
    )
    await server.start()
    address = f"127.0.0.1:{port}"
    stats_channel = rpc.channel(address)
    stub = trajectory_pb2_grpc.TrajectoryStub(stats_channel)

    async def stat(name: str) -> float:
        return (await stub.GetStats(trajectory_pb2.GetStatsRequest())).values.get(name, 0.0)

    async def publish(execs, poison: bool) -> None:  # type: ignore[no-untyped-def]
        prefix = "bad" if poison else "ok"  # the two workloads' ids would otherwise coincide
        for ex in execs:
            events = [step_event(run_id, c) for c in ex.calls] + [end_event(run_id, ex)]
            for ev in events:
                ev.task_id, ev.group_id = f"{prefix}-{ev.task_id}", f"{prefix}-{ev.group_id}"
                ev.execution_id, ev.event_id = f"{prefix}-{ev.execution_id}", f"{prefix}-{ev.event_id}"
            for ev in events[:-1]:
                if poison:
                    ev.completion_token_ids[0] = 100_000
                await bus.publish(subjects.steps(run_id, ev.task_id), ev, msg_id=ev.event_id)
            await bus.publish(
                subjects.executions(run_id, events[-1].task_id), events[-1], msg_id=events[-1].event_id
            )

    quarantine = tmp_path / "run" / "trainer" / "quarantine.jsonl"
    trainer_cfg = TrainerConfig(trajectory_address=address, checkpoint_every=1, lr=1e-2, pull_wait_s=0.3)
    published: list[int] = []

    async def sink(weights, metrics) -> None:  # type: ignore[no-untyped-def]
        published.append(weights.version)

    def source() -> TrajectoryBatchSource:
        return TrajectoryBatchSource(
            address, run_id, "trainer-0", 65_536, 0.3, vocab_size=512, quarantine_path=quarantine
        )

    try:
        poisoned, good = generate(_workload(1)), generate(_workload(2))
        await publish(poisoned, poison=True)
        await _until(lambda: _at_least(stat, "groups_scored", 1))
        first_source = source()
        trainer = Trainer(trainer_cfg, tmp_path / "run", first_source, sink, seed=0)
        run = asyncio.create_task(trainer.run(max_steps=1))
        await _until(lambda: _true(bool(first_source.quarantined)))
        assert not run.done(), "the trainer is still running after the poisoned batch"
        await publish(good, poison=False)
        await asyncio.wait_for(run, timeout=120)

        (bad_id, reason), *_ = first_source.quarantined.items()
        assert "token id 100000" in reason and "[0, 512)" in reason
        assert trainer.state.step == 1 and bad_id not in trainer.state.trained_batch_ids
        assert published == [1]
        record = json.loads(quarantine.read_text().splitlines()[0])
        assert record["batch_id"] == bad_id
        batch = await asyncio.to_thread(service.core.store.get_batch, bad_id)  # type: ignore[union-attr]
        assert batch is not None and batch.trained_at_version == -1  # acked as dropped

        # A restart whose journal names the poisoned batch skips it instead of crashing.
        restarted = source()
        assert bad_id in restarted.quarantined
        assert await restarted.pull(1, resume_batch_id=bad_id) is None
        await restarted.close()
        await first_source.close()
    finally:
        await stats_channel.close()
        await service.stop()
        await server.stop(0)
        await bus.close()
        engine.dispose()


async def _at_least(stat: Callable[[str], Awaitable[float]], name: str, value: float) -> bool:
    return await stat(name) >= value


async def _true(value: bool) -> bool:
    return value
