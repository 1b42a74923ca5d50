"""A minimal Service for lifecycle tests, run as its own process: `python tests/foundation/toy_service.py`.

It stands in for a real service at the outermost edge only: the lifecycle, NATS, Postgres, gRPC
health and /metrics around it are all real.
"""

from __future__ import annotations

import asyncio
import sys

from pydantic import Field

from gyre.config import CommonConfig, ConfigModel
from gyre.service import Runtime, Service, run_service


class ToyConfig(ConfigModel):
    crash_after_s: float | None = Field(
        None, description="If set, a background task raises after this many seconds."
    )


class ToyService(Service):
    name = "toy"

    def __init__(self, config: ToyConfig) -> None:
        self.config = config

    async def start(self, rt: Runtime) -> None:
        rt.spawn(self._loop(), "toy-loop")

    async def _loop(self) -> None:
        if self.config.crash_after_s is not None:
            await asyncio.sleep(self.config.crash_after_s)
            raise RuntimeError("toy loop failed on purpose")
        await asyncio.Event().wait()

    async def stop(self) -> None:
        print("TOY_DRAINED", flush=True)


def _factory(common: CommonConfig, config: ToyConfig) -> ToyService:
    return ToyService(config)


if __name__ == "__main__":
    raise SystemExit(run_service("toy", ToyConfig, _factory, migrations_dir=None, argv=sys.argv[1:]))
