"""Durable executions (services/rollout/resume.py): an execution cut mid-way and resumed from what the
bus stored continues exactly as an uninterrupted one (greedy), for every resumable environment.

Real parts: nats-server (session fixture), the step publisher, the router with the tiny torch model,
the environments, the trajectory's own tree. The one edge stand-in is `HaltAt`, a generator proxy
in front of the real router that never answers call k: what a rollout process that died during
call k looks like to the execution (the test then cancels it, as a SIGKILL would end it).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import numpy as np
import pytest

from gyre.bus import Bus, subjects
from gyre.model import ModelConfig
from gyre.pacing import Pacer, PacingConfig
from gyre.v1 import events_pb2
from gyre.workload import load_workload_file
from services.rollout.agent import Agent, AgentConfig, ExecutionSpec
from services.rollout.engines.base import Completion, GenerationRequest
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.environments.base import TaskFamily
from services.rollout.environments.longhorizon import LongHorizonEnv, LongHorizonFamily, LongHorizonSpec
from services.rollout.environments.workload_plans import WorkloadFamily
from services.rollout.environments.workspace import WorkspaceFamily
from services.rollout.executions import ExecutionManager
from services.rollout.resume import ResumePlan
from services.rollout.router import Router
from services.rollout.steps import BusStepSink
from services.trajectory.tree import TaskTree

ROOT = Path(__file__).resolve().parents[2]
E = events_pb2.ExecutionEvent
CONFIG = AgentConfig(temperature=0.0, max_tokens=3, max_calls=12, context="compaction", compact_every=3)


def family(kind: str, seed: int = 0) -> TaskFamily:
    if kind == "longhorizon":
        return LongHorizonFamily(LongHorizonSpec(min_turns=30, max_turns=40, seed=seed))
    if kind == "workload":
        workload = load_workload_file(ROOT / "examples" / "workloads" / "small.yaml")
        pacing = PacingConfig.model_validate(
            {"enabled": True, "workload_file": str(ROOT / "examples/workloads/small.yaml"), "time_scale": 1e9}
        )
        return WorkloadFamily(workload, Pacer(pacing), time_scale=1e9, tokens_per_call=CONFIG.max_tokens)
    return WorkspaceFamily.from_jsonl(ROOT / "examples" / "tasks" / "workspace.jsonl")


class HaltAt:
    """Edge stand-in (see module doc): forwards to the real router, except call `k`, which never returns."""

    def __init__(self, router: Router, k: int) -> None:
        self.router, self.k = router, k
        self.reached = asyncio.Event()  # set when call k came in (calls 0..k-1 were handed to the sink)

    async def generate(self, request: GenerationRequest) -> Completion:
        if request.request_id.endswith(f".{self.k}"):
            self.reached.set()
            await asyncio.Event().wait()
        return await self.router.generate(request)


async def stored_steps(bus: Bus, run_id: str) -> list[events_pb2.StepEvent]:
    return [
        events_pb2.StepEvent.FromString(m.data)
        async for m in bus.replay(subjects.steps(run_id, "*"), idle_timeout_s=2.0)
    ]


async def stored_executions(bus: Bus, run_id: str) -> list[events_pb2.ExecutionEvent]:
    return [
        events_pb2.ExecutionEvent.FromString(m.data)
        async for m in bus.replay(subjects.executions(run_id, "*"), idle_timeout_s=2.0)
    ]


def tree_of(steps: list[events_pb2.StepEvent]) -> TaskTree:
    tree = TaskTree("t")
    for st in sorted(steps, key=lambda s: s.call_seq):
        tree.insert_call(
            st.execution_id,
            st.call_seq,
            np.array(st.prompt_token_ids),
            np.array(st.completion_token_ids),
            np.array(st.completion_logprobs),
            np.array(st.completion_versions),
        )
    return tree


class Rig:
    """One rollout's worth of real parts on a real bus: router + torch engine, step publisher."""

    def __init__(self, bus: Bus) -> None:
        self.bus, self.router = bus, Router()
        self.sink = BusStepSink(bus)

    async def __aenter__(self) -> Rig:
        engine = TorchEngine("e0", "cpu0-0", ModelConfig.model_validate({}), init_seed=3)
        await engine.start()
        await self.router.add_engine(engine)
        self.sink.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sink.close()
        await self.router.remove_engine("cpu0-0")


def spec_for(kind: str, run_id: str) -> ExecutionSpec:
    task = {"longhorizon": "lh-00001", "workload": "wl-00000"}.get(kind)
    if task is None:
        task = WorkspaceFamily.from_jsonl(ROOT / "examples" / "tasks" / "workspace.jsonl").task_ids(1)[0]
    return ExecutionSpec(run_id, task, f"{task}-g0", f"{task}-g0-e0", kind, seed=7)


async def run_named(agent: Agent, spec: ExecutionSpec, fam: TaskFamily) -> object:
    """Run one execution in a task named by its id (as the execution manager does)."""
    return await asyncio.create_task(agent.run(spec, fam.make(spec.task_id)), name=spec.execution_id)


async def _cut_execution(bus: Bus, run_id: str, kind: str, k: int) -> ExecutionSpec:
    """Run one execution of `kind` until it is stuck in call `k` with calls 0..k-1 stored, then end
    it as a kill would (no end event, nothing more published)."""
    async with Rig(bus) as rig:
        spec = spec_for(kind, run_id)
        halt = HaltAt(rig.router, k)
        doomed = asyncio.create_task(
            Agent(halt, rig.sink, CONFIG).run(spec, family(kind).make(spec.task_id)), name=spec.execution_id
        )
        await halt.reached.wait()
        await rig.sink.flush()
        doomed.cancel()
        await asyncio.gather(doomed, return_exceptions=True)
    return spec


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["longhorizon", "workload", "workspace"])
async def test_a_resumed_execution_produces_the_token_stream_and_tree_of_an_uninterrupted_one(
    nats_url: str, kind: str
) -> None:
    bus = await Bus.connect(nats_url, name="resume-test")
    await bus.ensure_streams()
    whole, cut = f"whole{uuid.uuid4().hex[:6]}", f"cut{uuid.uuid4().hex[:6]}"
    k = 4  # the predecessor dies during call 4: calls 0..3 are stored
    try:
        async with Rig(bus) as rig:
            await run_named(Agent(rig.router, rig.sink, CONFIG), spec_for(kind, whole), family(kind))
        spec = await _cut_execution(bus, cut, kind, k)
        async with Rig(bus) as rig:  # the restarted process: new router, engine and publisher
            plan = await ResumePlan.load(bus, cut, idle_timeout_s=2.0)
            manager = ExecutionManager(
                Agent(rig.router, rig.sink, CONFIG), family(kind), run_id=cut, seed=7,
                max_live=4, continuous=False, incarnation=1,
            )  # fmt: skip
            resumed, ended = await manager.resume(plan, rig.sink, group_size=1)
            outcomes = await asyncio.gather(*manager.live.values())
        reference, steps = await stored_steps(bus, whole), await stored_steps(bus, cut)
        events = await stored_executions(bus, cut)
    finally:
        await bus.close()
    assert [p.execution_id for p in plan.points] == [spec.execution_id] and len(plan.points[0].steps) == k
    assert resumed == [spec.execution_id] and ended == []
    assert outcomes[0].resumed_calls == k and outcomes[0].kind != E.KIND_FAILED, outcomes[0].error
    assert len(reference) > k + 1  # the execution went on well past the cut
    assert [s.call_seq for s in steps] == list(range(len(reference)))  # contiguous, each call once
    assert [list(s.completion_token_ids) for s in steps] == [list(s.completion_token_ids) for s in reference]
    assert [list(s.prompt_token_ids) for s in steps] == [list(s.prompt_token_ids) for s in reference]
    a, b = tree_of(reference), tree_of(steps)
    assert len(b.nodes) == len(a.nodes) and b.signature(spec.execution_id) == a.signature(spec.execution_id)
    assert [e.kind for e in events] == [E.KIND_STARTED, E.KIND_RESUMED, outcomes[0].kind]
    assert events[1].num_calls == k


@pytest.mark.slow
async def test_an_environment_that_answers_the_replay_differently_ends_the_execution_with_the_reason(
    nats_url: str,
) -> None:
    bus = await Bus.connect(nats_url, name="resume-test")
    await bus.ensure_streams()
    run = f"div{uuid.uuid4().hex[:6]}"
    try:
        spec = await _cut_execution(bus, run, "longhorizon", 3)
        async with Rig(bus) as rig:
            plan = await ResumePlan.load(bus, run, idle_timeout_s=2.0)
            # the restarted process generates other tasks under the same ids: the replay cannot match
            manager = ExecutionManager(
                Agent(rig.router, rig.sink, CONFIG), family("longhorizon", seed=99), run_id=run, seed=7,
                max_live=4, continuous=False, incarnation=1,
            )  # fmt: skip
            await manager.resume(plan, rig.sink, group_size=1)
            (outcome,) = await asyncio.gather(*manager.live.values())
        steps = await stored_steps(bus, run)
    finally:
        await bus.close()
    assert outcome.kind == E.KIND_FAILED and outcome.error.startswith("could not resume"), outcome.error
    assert [s.call_seq for s in steps] == [0, 1, 2]  # nothing was added to the stored calls
    assert spec.execution_id == plan.points[0].execution_id


class FrozenLongHorizon(LongHorizonFamily):
    """The real longhorizon family, whose environments declare themselves not resumable."""

    def make(self, task_id: str) -> LongHorizonEnv:
        env = super().make(task_id)
        env.resumable = False  # type: ignore[misc]
        return env


@pytest.mark.slow
async def test_an_execution_of_an_environment_that_cannot_resume_is_ended_failed_with_the_reason(
    nats_url: str,
) -> None:
    bus = await Bus.connect(nats_url, name="resume-test")
    await bus.ensure_streams()
    run = f"frz{uuid.uuid4().hex[:6]}"
    try:
        spec = await _cut_execution(bus, run, "longhorizon", 2)
        async with Rig(bus) as rig:
            plan = await ResumePlan.load(bus, run, idle_timeout_s=2.0)
            manager = ExecutionManager(
                Agent(rig.router, rig.sink, CONFIG), FrozenLongHorizon(LongHorizonSpec(min_turns=30, max_turns=40)),
                run_id=run, seed=7, max_live=4, continuous=False, incarnation=1,
            )  # fmt: skip
            resumed, ended = await manager.resume(plan, rig.sink, group_size=1)
            await rig.sink.flush()
        events = await stored_executions(bus, run)
        again = await ResumePlan.load(bus, run, idle_timeout_s=2.0)
    finally:
        await bus.close()
    assert resumed == [] and ended == [spec.execution_id] and not manager.live
    assert events[-1].kind == E.KIND_FAILED and "cannot resume" in events[-1].error
    assert again.points == []  # ended: a later restart finds nothing left running
