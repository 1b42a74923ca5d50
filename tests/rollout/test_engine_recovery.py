"""An engine dies, the rollout lives (services/rollout/engine_recovery.py).

Real parts: the router, torch engines with the tiny model, the agent loop and the longhorizon
environment. The fault is injected at the outermost edge only, as in tests/ops/engine_fault_service.py:
`FaultyTorchEngine`, the real engine whose decode step raises after a number of steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from gyre.errors import Unavailable
from gyre.model import ModelConfig
from gyre.v1 import events_pb2
from services.rollout.agent import Agent, AgentConfig, ExecutionOutcome, ExecutionSpec
from services.rollout.engine_recovery import EngineRestarter
from services.rollout.engines.base import Engine, EngineState, GenerationRequest, Sampling
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.environments.longhorizon import LongHorizonFamily, LongHorizonSpec
from services.rollout.router import Router
from services.rollout.steps import MemoryStepSink
from tests.ops.engine_fault_service import FaultyTorchEngine

MODEL = ModelConfig.model_validate({})
FAMILY = LongHorizonFamily(LongHorizonSpec(min_turns=20, max_turns=30))
CONFIG = AgentConfig(temperature=1.0, max_tokens=4, max_calls=20)


class Spawned:
    """Runtime.spawn's contract for a test: run the coroutine as a task and keep it to inspect."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[Any]] = []

    def __call__(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.append(task)
        return task


def restarter_for(
    router: Router, spawn: Spawned, *, faulty_after: int | None = None, **kw: Any
) -> EngineRestarter:
    """A restarter whose fresh engines are real torch engines (faulty ones when `faulty_after` is set)."""
    seq = iter(range(1, 100))

    async def fresh(device_id: str) -> Engine:
        engine: TorchEngine
        if faulty_after is None:
            engine = TorchEngine(f"{device_id}-r{next(seq)}", device_id, MODEL, init_seed=1)
        else:
            engine = FaultyTorchEngine(
                faulty_after, f"{device_id}-r{next(seq)}", device_id, MODEL, init_seed=1
            )
        engine.on_failure = restarter.on_failure
        await engine.start()
        return engine

    restarter = EngineRestarter(router, fresh, spawn, **{"max_restarts": 3, "backoff_s": 0.0, **kw})
    return restarter


async def run_executions(router: Router, n: int) -> list[ExecutionOutcome]:
    agent = Agent(router, MemoryStepSink(), CONFIG)
    specs = [
        ExecutionSpec("r", f"lh-0000{i}", f"lh-0000{i}-g0", f"lh-0000{i}-g0-e0", "longhorizon", seed=3)
        for i in range(n)
    ]
    return await asyncio.gather(*(agent.run(s, FAMILY.make(s.task_id)) for s in specs))


async def test_a_crashed_engines_generations_resume_elsewhere_and_the_engine_comes_back() -> None:
    reference_router = Router()
    for d in ("d0", "d1"):
        engine = TorchEngine(f"{d}-e1", d, MODEL, init_seed=1)
        await engine.start()
        await reference_router.add_engine(engine)
    reference = await run_executions(reference_router, 4)

    router, spawn = Router(), Spawned()
    restarter = restarter_for(router, spawn)
    doomed = FaultyTorchEngine(6, "d0-e1", "d0", MODEL, init_seed=1, on_failure=restarter.on_failure)
    healthy = TorchEngine("d1-e1", "d1", MODEL, init_seed=1, on_failure=restarter.on_failure)
    for engine in (doomed, healthy):
        await engine.start()
        await router.add_engine(engine)
    outcomes = await run_executions(router, 4)
    await asyncio.gather(*spawn.tasks)  # the restart finished (raises if it failed)
    fresh = router.engines["d0"]
    # the fresh engine serves: two requests at once are placed one per engine
    await asyncio.gather(*(
        router.generate(GenerationRequest(f"probe{i}", [257, 65, 261], Sampling(max_tokens=3, seed=i)))
        for i in range(2)
    ))  # fmt: skip
    for d in ("d0", "d1"):
        await router.remove_engine(d)
        await reference_router.remove_engine(d)

    assert doomed.state is EngineState.STOPPED and fresh is not doomed and fresh.engine_id == "d0-r1"
    assert restarter.num_restarts == 1 and [f[0] for f in restarter.failures] == ["d0-e1"]
    assert router.stats.engine_failures >= 1 and router.stats.migrations >= 1
    assert fresh.tokens_generated > 0
    assert all(o.kind != events_pb2.ExecutionEvent.KIND_FAILED for o in outcomes)
    # what the executions saw is what they would have seen without the crash (seeded sampling)
    assert [o.completions for o in outcomes] == [o.completions for o in reference]
    assert sum(o.num_migrations for o in outcomes) >= 1


async def test_an_engine_that_keeps_crashing_past_its_restart_budget_takes_the_service_down() -> None:
    router, spawn = Router(), Spawned()
    restarter = restarter_for(router, spawn, faulty_after=0, max_restarts=1)
    doomed = FaultyTorchEngine(0, "d0-e1", "d0", MODEL, init_seed=1, on_failure=restarter.on_failure)
    healthy = TorchEngine("d1-e1", "d1", MODEL, init_seed=1)
    for engine in (doomed, healthy):
        await engine.start()
        await router.add_engine(engine)
    fatal: BaseException | None = None
    for i in range(40):  # requests keep coming; each fresh faulty engine dies at its first decode
        out = await asyncio.gather(*(
            router.generate(GenerationRequest(f"q{i}.{j}", [257, 65 + j, 261], Sampling(max_tokens=3, seed=j)))
            for j in range(2)
        ))  # fmt: skip
        assert all(len(o.token_ids) == 3 for o in out)  # every request still answered
        done = [t for t in spawn.tasks if t.done()]
        fatal = next((t.exception() for t in done if t.exception() is not None), None)
        if fatal is not None:
            break
        await asyncio.gather(*spawn.tasks, return_exceptions=True)
    for d in list(router.engines):
        await router.remove_engine(d)
    assert isinstance(fatal, Unavailable) and "restart budget 1" in str(fatal)
    assert restarter.restarts == {"d0": 1}
