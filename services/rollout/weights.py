"""Weight hot-swap: follow `gyre.weights.<run_id>` and switch every engine to the newest version.

Guarantees: versions only move forward (an older or repeated event is ignored; redelivery is
harmless); each engine switches at its next safe point (between decode steps) without aborting a
generation, so tokens before the switch carry the old version and tokens after it the new one;
a file whose sha256 differs from the event is refused (logged, counted, the engine keeps its
weights) and, with a staleness bound, the router then holds new generations until a good version
arrives. Engines started later begin with `latest` (see RolloutService).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gyre.errors import GyreError
from gyre.v1 import common_pb2, events_pb2

from .router import Router

log = logging.getLogger(__name__)


class WeightSwapper:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.latest: common_pb2.WeightVersion | None = None
        self.num_refused = 0
        self._lock = asyncio.Lock()
        # Called with each version once every engine loaded it (e.g. execution admission).
        self.on_loaded: Callable[[int], Awaitable[None]] | None = None

    async def handle(self, events: list[events_pb2.WeightsPublishedEvent]) -> None:
        """Bus handler: apply the newest version among `events`."""
        if events:
            await self.apply(max(events, key=lambda e: e.weights.version).weights)

    async def apply(self, weights: common_pb2.WeightVersion) -> None:
        async with self._lock:
            if self.latest is not None and weights.version <= self.latest.version:
                return
            await self.router.note_published(weights.version)
            results = await asyncio.gather(
                *(e.load_weights(weights) for e in list(self.router.engines.values())), return_exceptions=True
            )
            failures = [r for r in results if isinstance(r, BaseException)]
            for exc in failures:
                if not isinstance(exc, GyreError):
                    raise exc
                self.num_refused += 1
                log.error("weights v%d refused: %s", weights.version, exc)
            if not failures:
                self.latest = weights
                if self.on_loaded is not None:
                    await self.on_loaded(weights.version)
            await self.router.notify_weights_loaded()
