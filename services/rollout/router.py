"""Router: sends generation requests to the engines on devices leased to rollout, and migrates
in-flight generations when a device is taken away.

Guarantees:
- `generate` returns ONE completion per request, with exact tokens, log-probs and per-token
  weight versions, whatever happens to the engines underneath: when an engine is drained
  (`remove_engine`), each of its in-flight generations is cut at its current token and resumed
  on another engine with the tokens so far appended to its prompt (`GenerationRequest.resumed`);
  with no engine left the request is parked until `add_engine` brings one. No request fails
  because of a migration.
- An engine that dies (`EngineFailed`) is the same path: what it had generated for each request
  (exact tokens so far) is kept and the request resumes on another engine (counted in
  `engine_failures` and, when it had tokens, `migrations`). The dead engine stays in `engines`,
  STOPPED and so never picked, until `replace_engine` puts its restarted successor there
  (services/rollout/engine_recovery.py) or `remove_engine` drops it.
- Staleness bound: a generation is started (or resumed) only on an engine whose weight version
  is at least `latest_published - max_staleness`; if no engine qualifies, the request waits
  until one has loaded newer weights. `max_staleness < 0` disables the bound.
- Placement: the eligible engine whose decoding requests hold the fewest context tokens (decode is
  memory-bound, so that is the engine whose step a new request slows least, and long contexts
  spread instead of piling up), then the fewest active requests, then the engine id (so runs are
  reproducible). The simulator's router places by the same measure (reserved KV).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from gyre.errors import Conflict, NotFound

from .engines.base import Completion, Engine, EngineFailed, EngineState, GenerationRequest

log = logging.getLogger(__name__)


@dataclass
class RouterStats:
    requests: int = 0
    completed: int = 0
    migrations: int = 0
    migrated_tokens_reprefilled: int = 0
    parked_waits: int = 0
    engine_failures: int = 0  # generations whose engine died under them (resumed elsewhere)


class Router:
    def __init__(self, *, max_staleness: int = -1) -> None:
        self.engines: dict[str, Engine] = {}  # device_id -> engine
        self.max_staleness = max_staleness
        self.latest_published = 0
        self.stats = RouterStats()
        self._changed = asyncio.Condition()
        self.in_flight = 0

    # -- engines -------------------------------------------------------------------------------
    async def add_engine(self, engine: Engine) -> None:
        """Serve requests on a started engine (one per device)."""
        if engine.device_id in self.engines:
            raise Conflict(
                f"device {engine.device_id!r} already has engine {self.engines[engine.device_id].engine_id}"
            )
        self.engines[engine.device_id] = engine
        await self._notify()

    async def remove_engine(self, device_id: str) -> Engine:
        """Drain the engine of `device_id`: its in-flight generations move elsewhere. Returns it, stopped."""
        engine = self.engines.pop(device_id, None)
        if engine is None:
            raise NotFound(f"no engine on device {device_id!r}; engines on {sorted(self.engines)}")
        await engine.drain()
        await engine.close()
        await self._notify()
        return engine

    async def replace_engine(self, old: Engine, new: Engine) -> bool:
        """Put `new` (started) on `old`'s device if `old` is still the engine there; False (nothing
        changed) when the device was meanwhile removed or given another engine."""
        if self.engines.get(old.device_id) is not old or new.device_id != old.device_id:
            return False
        self.engines[old.device_id] = new
        await self._notify()
        return True

    async def note_published(self, version: int) -> None:
        """A newer weight version exists (engines will load it); tightens the staleness bound."""
        if version > self.latest_published:
            self.latest_published = version
            await self._notify()

    async def notify_weights_loaded(self) -> None:
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _eligible(self) -> list[Engine]:
        floor = self.latest_published - self.max_staleness if self.max_staleness >= 0 else None
        return [
            e
            for e in self.engines.values()
            if e.state is EngineState.SERVING and (floor is None or e.weight_version >= floor)
        ]

    async def _pick(self) -> Engine:
        async with self._changed:
            while True:
                eligible = self._eligible()
                if eligible:
                    return min(eligible, key=lambda e: (e.context_tokens, e.num_active, e.engine_id))
                self.stats.parked_waits += 1
                await self._changed.wait()

    # -- generation ----------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> Completion:
        """One completion for `request`, migrating across engines as devices come and go."""
        self.stats.requests += 1
        self.in_flight += 1
        total = Completion()
        current = request
        try:
            while True:
                engine = await self._pick()
                try:
                    part = await engine.generate(current)
                except EngineFailed as exc:  # resume elsewhere from what it generated
                    self.stats.engine_failures += 1
                    log.warning("request %s: %s; resuming elsewhere", request.request_id, exc)
                    part = exc.partial
                total.extend(part)
                if part.finish_reason != "cut":
                    self.stats.completed += 1
                    return total
                if len(total.token_ids) >= request.sampling.max_tokens:  # cut right at the end
                    total.finish_reason = "length"
                    self.stats.completed += 1
                    return total
                if part.token_ids:  # admitted work moved (a not-admitted request just retries)
                    total.num_migrations += 1
                    self.stats.migrations += 1
                    resumed_prompt = len(current.prompt_ids) + len(part.token_ids)
                    total.num_reprefilled_tokens += resumed_prompt
                    self.stats.migrated_tokens_reprefilled += resumed_prompt
                current = current.resumed(part.token_ids)
                log.debug(
                    "request %s cut after %d tokens; resuming", request.request_id, len(total.token_ids)
                )
        finally:
            self.in_flight -= 1
