"""An engine dies, the rollout lives: restart a crashed engine on its device and put it back.

    engine loop raises  -> the engine answers every request it held with EngineFailed (tokens so far)
                        -> the router resumes each on another engine (the migration path) or parks it
                        -> EngineRestarter.on_failure: a restart task (Runtime.spawn)
    restart task        -> wait restart_backoff_s * 2^(n-1)
                        -> a fresh engine on the same device (the service's factory: started, newest
                           weights loaded, so it joins at the version the pool serves now and follows
                           every later version like any engine)
                        -> Router.replace_engine(dead, fresh): admitted (then `catch_up` loads a version
                           published while it started); if the device was released meanwhile (a lease
                           moved it), the fresh engine is closed instead

Guarantees: no request fails because an engine died (as long as another engine exists or comes
back); a device never has two engines (replace_engine swaps only the dead one). A device whose
engine dies more than `max_restarts` times makes the restart task raise: the service goes down
loudly (Runtime.spawn) and its supervisor restarts the whole process, as before this module.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from gyre.errors import Unavailable

from .engines.base import Engine
from .router import Router

log = logging.getLogger(__name__)


class EngineRestarter:
    """Restarts engines whose loop died; one per rollout service."""

    def __init__(
        self,
        router: Router,
        new_engine: Callable[[str], Awaitable[Engine]],
        spawn: Callable[[Coroutine[Any, Any, Any], str], Any],
        *,
        max_restarts: int,
        backoff_s: float,
        catch_up: Callable[[Engine], Awaitable[None]] | None = None,
    ) -> None:
        """`new_engine(device_id)` returns a started engine with the newest weights loaded; `spawn`
        runs a background task whose exception is fatal to the service (Runtime.spawn); `catch_up`
        loads into an admitted engine a version published while it was starting."""
        self.router, self.new_engine, self.spawn, self.catch_up = router, new_engine, spawn, catch_up
        self.max_restarts, self.backoff_s = max_restarts, backoff_s
        self.restarts: dict[str, int] = {}  # device_id -> restarts begun on it (the budget's count)
        self.failures: list[tuple[str, str]] = []  # (engine_id, error) of every engine that died
        self.num_restarts = 0  # restarted engines admitted to the router so far

    def on_failure(self, engine: Engine, exc: BaseException) -> None:
        """The engine's loop died with `exc` (called from its done-callback): schedule its restart."""
        self.failures.append((engine.engine_id, repr(exc)))
        log.error("engine %s on %s died: %r; restarting it", engine.engine_id, engine.device_id, exc)
        self.spawn(self._restart(engine, exc), f"restart-{engine.engine_id}")

    async def _restart(self, dead: Engine, exc: BaseException) -> None:
        device = dead.device_id
        n = self.restarts.get(device, 0) + 1
        if n > self.max_restarts:
            raise Unavailable(
                f"the engine on {device} died {n} times (restart budget {self.max_restarts}); last: {exc!r}"
            )
        self.restarts[device] = n
        await asyncio.sleep(self.backoff_s * 2 ** (n - 1))
        if self.router.engines.get(device) is not dead:
            log.info("device %s was released while its engine was down; not restarting it", device)
            return
        fresh = await self.new_engine(device)
        if not await self.router.replace_engine(dead, fresh):
            await fresh.close()
            return
        self.num_restarts += 1
        await dead.close()
        if self.catch_up is not None:
            await self.catch_up(fresh)
        log.info(
            "engine %s restarted on %s as %s (weights v%d)", dead.engine_id, device, fresh.engine_id,
            fresh.weight_version,
        )  # fmt: skip
