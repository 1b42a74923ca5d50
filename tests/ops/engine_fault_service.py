"""A service process hosting a real TorchEngine whose decode step fails on purpose (for supervision tests).

`python tests/ops/engine_fault_service.py` runs under gyre.service like every Gyre service. The
fault is injected at the outermost edge only: a subclass of the real engine whose `_decode` raises
after `fail_after_steps` decode steps. Everything else is real: the engine loop, its supervision
(gyre.service.supervise), the lifecycle, NATS, Postgres and gRPC health. Once serving it submits
`num_requests` generations and prints, for each, `REQUEST <i> <outcome>` when it is answered, so a
test sees that every pending request failed with an error instead of hanging.
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


if __name__ == "__main__":
    raise SystemExit(
        run_service("enginefault", FaultConfig, _factory, migrations_dir=None, argv=sys.argv[1:])
    )
