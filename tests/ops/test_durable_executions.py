"""A rollout process SIGKILLed mid-execution and started again resumes the executions it left running.

Real processes and servers throughout: `python -m services.rollout` (standalone, torch engine) on the
session's nats-server and Postgres, killed with SIGKILL while the long task's executions are live,
then started as the supervisor would (GYRE_INCARNATION=1). What it must show: the same execution ids
finish (not FAILED), each with a RESUMED event; their calls are contiguous, each stored once; each
execution's calls form one chain in the trajectory's tree (context `none`: no branch, no duplicate).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import grpc
import numpy as np
import pytest

from gyre.bus import Bus, subjects
from gyre.v1 import events_pb2, rollout_pb2, rollout_pb2_grpc
from services.trajectory.tree import TaskTree
from tests.helpers.stream import expanded_prompts

ROOT = Path(__file__).resolve().parents[2]
E = events_pb2.ExecutionEvent
RUN = "durable-test"
LONG_TASK = "lh-00009"  # horizon 85 at seed 0 (generate_task): live for many calls
ENDS = (E.KIND_FINISHED, E.KIND_TRUNCATED, E.KIND_FAILED)


def _start(cfg: Path, env: dict[str, str], incarnation: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.rollout", "--config", str(cfg)],
        cwd=ROOT, env={**env, "GYRE_INCARNATION": str(incarnation)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


async def _ready_port(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120)
    assert line.startswith("GYRE_READY rollout"), line
    return int(line.split()[2])


async def _executions(bus: Bus) -> list[events_pb2.ExecutionEvent]:
    return [E.FromString(m.data) async for m in bus.replay(subjects.executions(RUN, "*"), idle_timeout_s=2.0)]


@pytest.mark.slow
@pytest.mark.integration
async def test_a_killed_rollout_restarted_resumes_every_live_execution_with_contiguous_calls(
    nats_url: str, postgres_url: str, tmp_path: Path
) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_id: {RUN}\nrun_dir: {tmp_path / 'run'}\n"
        "rollout:\n  num_devices: 1\n  num_tasks: 10\n  group_size: 2\n  longhorizon_max_turns: 200\n"
        "  max_tokens: 2\n  context: none\n  openai: {port: null}\n"
    )
    env = {
        **os.environ,
        "GYRE_NATS_URL": nats_url,
        "GYRE_DATABASE_URL": postgres_url,
        "PYTHONWARNINGS": "ignore",
    }
    bus = await Bus.connect(nats_url, name="durable-test")
    await bus.ensure_streams()
    first = _start(cfg, env, 0)
    second: subprocess.Popen[str] | None = None
    try:
        await _ready_port(first)
        async for st in bus.tail(subjects.steps(RUN, LONG_TASK), events_pb2.StepEvent, from_start=True):
            if st.call_seq >= 5:
                break
        first.send_signal(signal.SIGKILL)
        assert await asyncio.to_thread(first.wait, 60) == -signal.SIGKILL
        events = await _executions(bus)
        ended = {e.execution_id for e in events if e.kind in ENDS}
        live_at_kill = {e.execution_id for e in events if e.kind == E.KIND_STARTED} - ended
        assert {f"{LONG_TASK}-g0-e0", f"{LONG_TASK}-g0-e1"} <= live_at_kill

        second = _start(cfg, env, 1)
        port = await _ready_port(second)
        done: dict[str, events_pb2.ExecutionEvent] = {}

        async def until_all_ended() -> None:
            async for ev in bus.tail(subjects.executions(RUN, "*"), E, from_start=True):
                if ev.kind in ENDS and ev.execution_id in live_at_kill:
                    done[ev.execution_id] = ev
                if set(done) == live_at_kill:
                    return

        await asyncio.wait_for(until_all_ended(), 300)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            status = await rollout_pb2_grpc.RolloutStub(ch).GetStatus(rollout_pb2.GetStatusRequest())
        second.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(second.wait, 120) == 0
        events = await _executions(bus)
        steps = [
            events_pb2.StepEvent.FromString(m.data)
            async for m in bus.replay(subjects.steps(RUN, "*"), idle_timeout_s=2.0)
        ]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
        await bus.close()

    assert status.executions_resumed == len(live_at_kill) and status.executions_interrupted == 0
    resumed = {e.execution_id for e in events if e.kind == E.KIND_RESUMED}
    assert resumed == live_at_kill
    assert all(done[x].kind in (E.KIND_FINISHED, E.KIND_TRUNCATED) for x in live_at_kill), done
    assert not [e for e in events if e.kind == E.KIND_FAILED]
    # no task of a resumed group was started again
    restarted = {e.task_id for e in events if e.kind == E.KIND_STARTED and "-r1g" in e.group_id}
    assert not restarted & {x.rsplit("-g", 1)[0] for x in live_at_kill}
    copies = Counter(s.event_id for s in steps)
    assert max(copies.values()) == 1  # each call stored once
    by_execution: dict[str, list[events_pb2.StepEvent]] = defaultdict(list)
    for s in steps:
        by_execution[s.execution_id].append(s)
    for eid in live_at_kill:
        calls = sorted(by_execution[eid], key=lambda s: s.call_seq)
        assert [s.call_seq for s in calls] == list(range(done[eid].num_calls)), eid
        tree = TaskTree(eid)
        prompts = expanded_prompts(calls)  # calls after the first travel compact
        for s in calls:
            tree.insert_call(
                eid, s.call_seq, np.array(prompts[s.call_seq]), np.array(s.completion_token_ids),
                np.array(s.completion_logprobs), np.array(s.completion_versions),
            )  # fmt: skip
        assert len(tree.leaves_of(eid)) == 1 and len(tree.nodes) == len(calls), eid  # one chain
