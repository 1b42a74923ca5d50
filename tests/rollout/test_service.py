"""The rollout service as its own process (standalone: no scheduler), on real NATS and Postgres."""

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from gyre.bus import Bus, subjects
from gyre.lease_client import LeaseAction, decide
from gyre.v1 import common_pb2, events_pb2, rollout_pb2, rollout_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
async def test_service_runs_executions_answers_grpc_and_stops_cleanly(
    nats_url: str, postgres_url: str, tmp_path: Path
) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "run_id: svc-test\n"
        "rollout:\n  num_devices: 2\n  num_tasks: 2\n  group_size: 2\n  longhorizon_max_turns: 6\n"
        "  max_tokens: 2\n  openai: {port: null}\n"
    )
    env = {
        **os.environ,
        "GYRE_NATS_URL": nats_url,
        "GYRE_DATABASE_URL": postgres_url,
        "PYTHONWARNINGS": "ignore",
    }
    bus = await Bus.connect(nats_url, name="svc-test")
    await bus.ensure_streams()
    ended: list[events_pb2.ExecutionEvent] = []

    async def collect() -> None:
        async for ev in bus.tail(
            subjects.executions("svc-test", "*"), events_pb2.ExecutionEvent, from_start=True
        ):
            if ev.kind != events_pb2.ExecutionEvent.KIND_STARTED:
                ended.append(ev)
            if len(ended) == 4:
                return

    collector = asyncio.create_task(collect())
    proc = subprocess.Popen(  # noqa: ASYNC220 - one child, read in a thread
        [sys.executable, "-m", "services.rollout", "--config", str(cfg)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120)
        assert line.startswith("GYRE_READY rollout"), line
        port = int(line.split()[2])
        await asyncio.wait_for(collector, 120)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = rollout_pb2_grpc.RolloutStub(ch)
            status = await stub.GetStatus(rollout_pb2.GetStatusRequest())
            assert len(status.engines) == 2 and status.executions_interrupted == 0
            gen = await stub.Generate(
                rollout_pb2.GenerateRequest(
                    request_id="g1",
                    prompt_token_ids=[257, 65, 261],
                    sampling=rollout_pb2.SamplingParams(max_tokens=3),
                )
            )
            assert len(gen.token_ids) == len(gen.logprobs) == len(gen.versions) <= 3
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(rollout_pb2.GenerateRequest(request_id="g2", prompt_token_ids=[257]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        await bus.close()
    assert {e.execution_id for e in ended} == {f"lh-0000{t}-g0-e{k}" for t in range(2) for k in range(2)}


def test_lease_decisions_follow_the_handoff_protocol() -> None:
    S = common_pb2
    me, role = "rollout-0", S.DEVICE_ROLE_ROLLOUT
    draining = S.Lease(device_id="d", holder=me, state=S.LEASE_STATE_DRAINING, role=role, epoch=3)
    granted = S.Lease(device_id="d", target_holder=me, target_role=role, state=S.LEASE_STATE_GRANTED, epoch=3)
    granted_train = S.Lease(
        device_id="d", target_holder=me, target_role=S.DEVICE_ROLE_TRAIN, state=S.LEASE_STATE_GRANTED
    )
    active = S.Lease(device_id="d", holder=me, role=role, state=S.LEASE_STATE_ACTIVE, epoch=3)
    others = S.Lease(
        device_id="d", holder="trainer-0", role=S.DEVICE_ROLE_TRAIN, state=S.LEASE_STATE_ACTIVE, epoch=4
    )
    released = S.Lease(device_id="d", target_holder=me, state=S.LEASE_STATE_RELEASED, epoch=3)
    assert decide(draining, me, role, using_since=1) is LeaseAction.RELEASE
    assert decide(granted, me, role, using_since=None) is LeaseAction.ACQUIRE
    assert decide(granted_train, me, role, using_since=None) is LeaseAction.NONE
    assert decide(active, me, role, using_since=None) is LeaseAction.START
    assert decide(active, me, role, using_since=3) is LeaseAction.NONE
    assert decide(others, me, role, using_since=None) is LeaseAction.NONE
    # in use, and a newer epoch gave the device to someone else: no longer ours
    assert decide(others, me, role, using_since=3) is LeaseAction.FENCED
    # an older step of the handoff that gave it to us (same epoch), redelivered: nothing to do
    assert decide(released, me, role, using_since=3) is LeaseAction.NONE


def test_the_engines_initial_weights_follow_the_runs_seed_as_the_trainers_do(tmp_path) -> None:
    from gyre.config import CommonConfig
    from services.rollout.config import RolloutConfig
    from services.rollout.service import RolloutService

    common = CommonConfig.model_validate({"run_id": "s", "run_dir": str(tmp_path), "seed": 5})
    assert RolloutService(common, RolloutConfig.model_validate({})).init_seed == 5
    pinned = RolloutConfig.model_validate({"init_seed": 2})  # explicit: kept (and warned about)
    assert RolloutService(common, pinned).init_seed == 2


async def test_the_load_the_scheduler_receives_has_one_engine_entry_per_engine_with_its_residents(
    tmp_path,
) -> None:
    """`RolloutService._load` (what LeaseClient reports as WorkerLoad): one EngineLoad per engine of
    the router, by device id, with the requests resident on it and the context they hold. The engines
    are paced on a frozen clock (the outermost edge, time), so finished sequences stay admitted
    until drained and the counts can be read without racing the engine loop."""
    from gyre.config import CommonConfig
    from gyre.model import ModelConfig
    from gyre.pacing import Pacer, PacingConfig
    from services.rollout.agent import Agent, AgentConfig
    from services.rollout.config import RolloutConfig
    from services.rollout.engines.base import GenerationRequest, Sampling
    from services.rollout.engines.torch_engine import TorchEngine
    from services.rollout.executions import ExecutionManager
    from services.rollout.service import RolloutService, make_family
    from services.rollout.steps import MemoryStepSink

    frozen = 1000.0

    async def no_sleep(_s: float) -> None:
        return None

    pacing = PacingConfig.model_validate(
        {
            "enabled": True,
            "workload_file": str(ROOT / "examples" / "workloads" / "small.yaml"),
            "time_scale": 10.0,
        }
    )
    common = CommonConfig.model_validate({"run_id": "load", "run_dir": str(tmp_path)})
    cfg = RolloutConfig.model_validate({"engine_max_batch": 4})
    svc = RolloutService(common, cfg)
    # What start() builds besides the bus: the execution manager (none started), on a real in-memory sink.
    svc.executions = ExecutionManager(
        Agent(svc.router, MemoryStepSink(), AgentConfig()), make_family(cfg, 0), run_id="load", seed=0,
        max_live=cfg.max_live_executions, continuous=False,
    )  # fmt: skip
    engines = [
        TorchEngine(f"e{i}", f"cpu0-{i}", ModelConfig.model_validate({}), max_batch=4,
                    pacer=Pacer(pacing, clock=lambda: frozen, sleep=no_sleep))
        for i in range(2)
    ]  # fmt: skip
    for engine in engines:
        await engine.start()
        await svc.router.add_engine(engine)
    prompts = [[257, 65, 66, 261], [257, 70, 261]]
    calls = [
        asyncio.create_task(
            engines[0].generate(GenerationRequest(f"r{i}", p, Sampling(max_tokens=3, stop_token_ids=())))
        )
        for i, p in enumerate(prompts)
    ]
    try:
        while engines[0].tokens_generated < 6:  # noqa: ASYNC110 - polling a counter
            await asyncio.sleep(0.005)
        load = svc._load()
        assert [(e.device_id, e.executions, e.generating, e.context_tokens) for e in load.engines] == [
            ("cpu0-0", 2, 2, (4 + 3) + (3 + 3)),
            ("cpu0-1", 0, 0, 0),
        ]
        assert load.running_generations == 2 and load.engine_capacity == 4
    finally:
        for device in list(svc.router.engines):
            await svc.router.remove_engine(device)  # drained: the held sequences are cut
    assert [(await c).finish_reason for c in calls] == ["cut", "cut"]
