"""Weight hot-swap: follow `gyre.weights.<run_id>` and switch every engine to the newest version.

Guarantees:
- Versions only move forward: an older or repeated event is ignored (redelivery is harmless).
- Every version is checked BEFORE anything is opened or announced (`check_weights`): the URI must
  be a plain `file://` path that resolves (symlinks followed) to a regular file inside the
  configured weights store; the sha256 must be given (64 lowercase hex digits) and the engine
  verifies it against the file before loading; the version may be at most `max_version_ahead`
  versions ahead of the version loaded now (0 before the first); the file's sha256 is computed
  (off the event loop) and compared before the version is announced. A version that fails is
  refused: no engine opens the file, the router's staleness floor does not move (so a forged
  "version 10^9" cannot starve generation), and the refusal is counted by reason in `refused`.
- Each engine switches at its next safe point (between decode steps) without aborting a
  generation, so tokens before the switch carry the old version and tokens after it the new one.
  Engines verify the sha256 again when they load (the file could change in between); a refusal
  there is counted as `checksum` and the engines keep their weights. Engines started later
  begin with `latest` (see RolloutService). A forged event that names a genuine store file under
  a larger version can relabel old weights, at most `max_version_ahead` versions ahead: only
  NATS permissions (only the trainer publishes weights) close that.
- From the bus (`handle`), a batch is applied as its newest VALID event: a forged event in the
  same batch as the trainer's real one does not take the real one down with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import unquote, urlparse

from gyre.errors import GyreError, InvalidArgument
from gyre.model.weights import sha256_file
from gyre.v1 import common_pb2, events_pb2

from .engines.base import EngineState
from .router import Router

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")

#: Default bound on how far a published version may jump ahead of the loaded one (see check_weights).
DEFAULT_MAX_VERSION_AHEAD = 1000


class WeightsRefused(InvalidArgument):
    """A weights event failed validation; `reason` is a short counter key (uri, sha256, version...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def weights_path(uri: str, store: Path) -> Path:
    """The file a weights URI names, if it lies inside `store`; else WeightsRefused.

    Accepted: `file://<absolute path>` (or `file://localhost/...`) with no percent-escapes, query or
    fragment, resolving (after symlinks) to an existing regular file under the resolved store.
    """
    parsed = urlparse(uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise WeightsRefused("uri", f"weights URI {uri[:200]!r} is not a file:// URI of this machine")
    if parsed.query or parsed.fragment or parsed.params or unquote(parsed.path) != parsed.path:
        raise WeightsRefused("uri", f"weights URI {uri[:200]!r} must be a plain path (no %, ?, #, ;)")
    if "\x00" in parsed.path or not parsed.path.startswith("/"):
        raise WeightsRefused("uri", f"weights URI {uri[:200]!r} must name an absolute path")
    root = Path(os.path.realpath(store))
    path = Path(os.path.realpath(parsed.path))
    if root not in path.parents:
        raise WeightsRefused("uri", f"weights URI {uri[:200]!r} is outside the weights store {root}")
    if not path.is_file():
        raise WeightsRefused("uri", f"weights file {path} does not exist in the weights store")
    return path


class WeightSwapper:
    """Validates weight versions and loads them into every engine of the router.

    `store`: the weights store directory (the trainer writes `<run_dir>/weights/vNNNNNN.safetensors`).
    `max_version_ahead`: largest accepted `version - loaded version` (a trainer publishes one version
    per step, so a rollout that restarts or joins late sees its durable consumer replay them in order).
    """

    def __init__(
        self, router: Router, *, store: Path, max_version_ahead: int = DEFAULT_MAX_VERSION_AHEAD
    ) -> None:
        self.router = router
        self.store = Path(store)
        self.max_version_ahead = max_version_ahead
        self.latest: common_pb2.WeightVersion | None = None
        self.refused: Counter[str] = Counter()
        self._lock = asyncio.Lock()
        # Called with each version once every engine loaded it (e.g. execution admission).
        self.on_loaded: Callable[[int], Awaitable[None]] | None = None

    @property
    def num_refused(self) -> int:
        """Weight versions refused so far (all reasons)."""
        return sum(self.refused.values())

    @property
    def loaded_version(self) -> int:
        return self.latest.version if self.latest is not None else 0

    def check_weights(self, weights: common_pb2.WeightVersion) -> Path:
        """The validated weights file of `weights`, or WeightsRefused (nothing is opened but stat)."""
        if weights.version <= 0:
            raise WeightsRefused("version", f"weights version {weights.version} must be >= 1")
        if weights.version - self.loaded_version > self.max_version_ahead:
            raise WeightsRefused(
                "version",
                f"weights version {weights.version} is more than {self.max_version_ahead} ahead of the "
                f"loaded version {self.loaded_version} (rollout.weights_max_version_ahead)",
            )
        if not _SHA256.match(weights.sha256):
            raise WeightsRefused("sha256", "weights need a sha256 of 64 lowercase hex digits")
        return weights_path(weights.uri, self.store)

    def _refuse(self, weights: common_pb2.WeightVersion, exc: WeightsRefused) -> None:
        self.refused[exc.reason] += 1
        n = self.refused[exc.reason]
        if n <= 3 or n % 1000 == 0:  # rate-limited: a flood of forged events is not a flood of logs
            log.error("weights v%d refused (%s, %d so far): %s", weights.version, exc.reason, n, exc)

    async def handle(self, events: list[events_pb2.WeightsPublishedEvent]) -> None:
        """Bus handler: apply the newest valid version among `events`; invalid ones are counted, acked."""
        for ev in sorted(events, key=lambda e: e.weights.version, reverse=True):
            if self.latest is not None and ev.weights.version <= self.latest.version:
                return
            try:
                await self.apply(ev.weights)
            except WeightsRefused:
                continue  # counted in apply; try the next newest
            return

    async def apply(self, weights: common_pb2.WeightVersion) -> None:
        """Validate, then load `weights` into every engine; WeightsRefused when invalid (counted)."""
        async with self._lock:
            if self.latest is not None and weights.version <= self.latest.version:
                return
            try:
                path = self.check_weights(weights)
                digest = await asyncio.to_thread(sha256_file, path)  # before the floor moves
                if digest != weights.sha256:
                    raise WeightsRefused(
                        "checksum", f"weights {path} have sha256 {digest}, not {weights.sha256}"
                    )
            except WeightsRefused as exc:
                self._refuse(weights, exc)
                raise
            await self.router.note_published(weights.version)
            results = await asyncio.gather(
                *(
                    e.load_weights(weights)
                    for e in list(self.router.engines.values())
                    if e.state is not EngineState.STOPPED  # a dead engine waiting for its restart
                ),
                return_exceptions=True,
            )
            failures = [r for r in results if isinstance(r, BaseException)]
            for failure in failures:
                if not isinstance(failure, GyreError):
                    raise failure
                self._refuse(weights, WeightsRefused("checksum", str(failure)))
            if not failures:
                self.latest = weights
                if self.on_loaded is not None:
                    await self.on_loaded(weights.version)
            await self.router.notify_weights_loaded()
