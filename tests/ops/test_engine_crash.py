"""An engine dies inside a real rollout process: the process keeps serving, no execution is lost.

The rollout is the real service (`tests/ops/engine_fault_service.py --rollout`: every part of
services/rollout/service.py) on the session's nats-server and Postgres; the one fault is at the
edge, its first engine's decode step raising after a few steps (FaultyTorchEngine).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from gyre.bus import Bus, subjects
from gyre.v1 import common_pb2, events_pb2, rollout_pb2, rollout_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
FAULT_SERVICE = Path(__file__).with_name("engine_fault_service.py")
E = events_pb2.ExecutionEvent


@pytest.mark.slow
@pytest.mark.integration
async def test_a_rollout_whose_engine_crashes_restarts_it_keeps_serving_and_loses_no_execution(
    nats_url: str, postgres_url: str, tmp_path: Path
) -> None:
    run = "engine-crash-test"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_id: {run}\nrun_dir: {tmp_path / 'run'}\n"
        "rollout:\n  num_devices: 2\n  num_tasks: 4\n  group_size: 2\n  longhorizon_max_turns: 30\n"
        "  max_tokens: 3\n  openai: {port: null}\n  engine_restart_backoff_s: 0.2\n"
    )
    env = {**os.environ, "GYRE_NATS_URL": nats_url, "GYRE_DATABASE_URL": postgres_url,
           "PYTHONWARNINGS": "ignore", "GYRE_TEST_FAIL_AFTER_STEPS": "3", "PYTHONPATH": str(ROOT)}  # fmt: skip
    bus = await Bus.connect(nats_url, name="engine-crash-test")
    await bus.ensure_streams()
    proc = subprocess.Popen(  # noqa: ASYNC220 - one child, read in a thread
        [sys.executable, str(FAULT_SERVICE), "--rollout", "--config", str(cfg)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    ended: dict[str, events_pb2.ExecutionEvent] = {}
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120)
        assert line.startswith("GYRE_READY rollout"), line
        port = int(line.split()[2])

        async def collect() -> None:
            async for ev in bus.tail(subjects.executions(run, "*"), E, from_start=True):
                if ev.kind != E.KIND_STARTED:
                    ended[ev.execution_id] = ev
                if len(ended) == 8:
                    return

        await asyncio.wait_for(collect(), 300)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = rollout_pb2_grpc.RolloutStub(ch)
            for _ in range(300):  # the restarted engine is admitted (it builds its model first)
                status = await stub.GetStatus(rollout_pb2.GetStatusRequest())
                if status.engine_restarts:
                    break
                await asyncio.sleep(0.2)
        assert proc.poll() is None  # still alive
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 120)
        stderr = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
        await bus.close()
    assert code == 0, stderr[-3000:]
    # the fault really happened (on failure, the rollout's log and status say what it did instead)
    assert "injected decode fault" in stderr, (str(status), stderr[-6000:])
    assert status.engine_restarts == 1 and status.state == common_pb2.SERVICE_STATE_SERVING, status
    assert sorted(e.engine_id for e in status.engines) == ["cpu0-0-e3", "cpu0-1-e2"], status
    assert all(e.state == "serving" for e in status.engines), status
    assert set(ended) == {f"lh-0000{t}-g0-e{k}" for t in range(4) for k in range(2)}
    assert not [e for e in ended.values() if e.kind == E.KIND_FAILED], ended
    assert status.executions_interrupted == 0


async def test_an_injected_device_fault_fails_the_engine_like_a_crash_answering_held_requests_with_their_tokens() -> (
    None
):
    from gyre.model import ModelConfig
    from services.rollout.engines.base import EngineFailed, GenerationRequest, Sampling
    from services.rollout.engines.torch_engine import EngineFault, TorchEngine

    failures: list[BaseException] = []
    engine = TorchEngine(
        "d0-e1",
        "d0",
        ModelConfig.model_validate({}),
        init_seed=1,
        on_failure=lambda e, exc: failures.append(exc),
    )
    await engine.start()
    request = GenerationRequest(
        "r0", [1, 2, 3], Sampling(max_tokens=200, stop_token_ids=()), execution_id="x0"
    )
    pending = asyncio.ensure_future(engine.generate(request))
    while engine.tokens_generated < 3:  # noqa: ASYNC110 (polling the engine: it is decoding)
        await asyncio.sleep(0.01)
    engine.inject_fault("injected device fault (test)")
    with pytest.raises(EngineFailed) as raised:
        await pending
    await asyncio.sleep(0)  # the done-callback runs
    assert 0 < len(raised.value.partial.token_ids) < 200  # cut where it was, tokens kept for the resume
    assert len(failures) == 1 and isinstance(failures[0], EngineFault)
    with pytest.raises(EngineFailed):
        await engine.generate(request)  # a failed engine takes nothing more
