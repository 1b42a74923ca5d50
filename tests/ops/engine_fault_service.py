"""A service process hosting a real TorchEngine whose decode step fails on purpose (for supervision tests).

`python tests/ops/engine_fault_service.py` runs under gyre.service like every Gyre service. The
fault is injected at the outermost edge only: a subclass of the real engine whose `_decode` raises
after `fail_after_steps` decode steps. Everything else is real: the engine loop, its supervision
(gyre.service.supervise), the lifecycle, NATS, Postgres and gRPC health. Once serving it submits
`num_requests` generations and prints, for each, `REQUEST <i> <outcome>` when it is answered, so a
test sees that every pending request failed with an error instead of hanging.

`python tests/ops/engine_fault_service.py --rollout --config run.yaml` runs the real rollout service
instead (services/rollout/service.py, every part of it), except that the first engine it starts on
its first device is a `FaultyTorchEngine` (`GYRE_TEST_FAIL_AFTER_STEPS` decode steps, default 20):
the rollout must live on, its restarter bringing the engine back.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from pydantic import Field

from gyre.config import CommonConfig, ConfigModel
from gyre.model import ModelConfig
from gyre.service import Runtime, Service, run_service
from services.rollout.engines.base import GenerationRequest, Sampling
from services.rollout.engines.torch_engine import TorchEngine


class FaultConfig(ConfigModel):
    fail_after_steps: int = Field(3, description="Decode steps before the injected fault raises.")
    num_requests: int = Field(4, description="Generations submitted once the service serves.")


class FaultyTorchEngine(TorchEngine):
    """The real engine; its decode raises after `fail_after_steps` steps (the injected fault)."""

    def __init__(self, fail_after_steps: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._steps_left = fail_after_steps

    def _decode(self, seqs: list[Any]) -> None:
        self._steps_left -= 1
        if self._steps_left < 0:
            raise RuntimeError("injected decode fault")
        super()._decode(seqs)


class EngineFaultService(Service):
    name = "enginefault"

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self.engine = FaultyTorchEngine(
            config.fail_after_steps, "e0", "d0", ModelConfig.model_validate({}), init_seed=1
        )

    async def start(self, rt: Runtime) -> None:
        await self.engine.start()
        rt.spawn(self._submit(), "submit")

    async def _one(self, i: int) -> None:
        request = GenerationRequest(
            f"r{i}", [1, 2, 3 + i], Sampling(max_tokens=50, stop_token_ids=()), execution_id=f"x{i}"
        )
        try:
            out = await self.engine.generate(request)
            print(f"REQUEST {i} completed {out.finish_reason}", flush=True)
        except Exception as exc:
            print(f"REQUEST {i} failed {type(exc).__name__}: {exc}", flush=True)

    async def _submit(self) -> None:
        await asyncio.gather(*(self._one(i) for i in range(self.config.num_requests)))
        await asyncio.Event().wait()


def _factory(common: CommonConfig, config: FaultConfig) -> EngineFaultService:
    return EngineFaultService(config)


def _faulty_rollout(common: CommonConfig, config: Any) -> Service:
    """The real rollout service whose first engine is faulty (the edge: its decode step)."""
    import os

    from services.rollout.engines.base import Engine
    from services.rollout.service import RolloutService

    fail_after = int(os.environ.get("GYRE_TEST_FAIL_AFTER_STEPS", "20"))

    class FaultyFirstEngineRollout(RolloutService):
        def _new_engine(self, device_id: str) -> Engine:
            engine = super()._new_engine(device_id)
            if self._engine_seq > 1 or not isinstance(engine, TorchEngine):
                return engine
            return FaultyTorchEngine(
                fail_after, engine.engine_id, device_id, engine.model_config, max_batch=engine.max_batch,
                init_seed=engine.init_seed, on_failure=engine.on_failure,
            )  # fmt: skip

    return FaultyFirstEngineRollout(common, config)


if __name__ == "__main__":
    if "--rollout" in sys.argv:
        from services.rollout.config import RolloutConfig

        argv = [a for a in sys.argv[1:] if a != "--rollout"]
        raise SystemExit(
            run_service("rollout", RolloutConfig, _faulty_rollout, migrations_dir=None, argv=argv)
        )
    raise SystemExit(
        run_service("enginefault", FaultConfig, _factory, migrations_dir=None, argv=sys.argv[1:])
    )
