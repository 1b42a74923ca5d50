"""The weights store: `run_dir/weights/vNNNNNN.safetensors`, one file per published version, pruned.

The trainer (rank 0, the only writer) writes version v with `gyre.model.save_weights` — a temp file
`vNNNNNN.safetensors.tmp` renamed onto `vNNNNNN.safetensors`; the sha256 travels in the
WeightsPublishedEvent, not in a sidecar file — and, once the event is sent, calls
`prune_versions(weights_dir, v, keep)`.

Guarantee: at most `keep` versions on disk after each publish; a version the staleness bound can
still ask for is never deleted. The versions kept are the newest `keep` (newest - keep + 1 ..
newest), and `TrainerConfig.weight_versions_kept` makes `keep` at least `max_staleness + 1`: every
version whose tokens the trajectory service can still train (>= newest - max_staleness), so also
every version a rollout engine may still be asked to load, stays. The default, `max_staleness + 2`,
keeps one more for a rollout that is loading the previous newest while the next is published.
Only files named `vNNNNNN.safetensors` (and their leftover `.tmp`) are ever deleted, never the
newest version, never one newer than it; a file already gone is not an error.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("gyre.trainer.weights")

#: A version file and its sidecars (the temp file save_weights renames; left over by a crash).
_VERSION_FILE = re.compile(r"^v(\d{6,})\.safetensors(\.tmp)?$")


def version_path(weights_dir: Path, version: int) -> Path:
    """Where version `version` lives in the store."""
    return Path(weights_dir) / f"v{version:06d}.safetensors"


def stored_versions(weights_dir: Path) -> list[int]:
    """The versions whose `vNNNNNN.safetensors` file is in the store, oldest first."""
    try:
        names = [p.name for p in Path(weights_dir).iterdir()]
    except FileNotFoundError:
        return []
    found = (_VERSION_FILE.match(name) for name in names)
    return sorted({int(m.group(1)) for m in found if m and not m.group(2)})


def prune_versions(weights_dir: Path, newest: int, keep: int | None) -> list[Path]:
    """Delete the version files (and sidecars) older than `newest - keep + 1`; return what was deleted.

    At most `keep` versions on disk after each publish; a version the staleness bound can still ask
    for is never deleted (the caller's `keep` covers the bound: TrainerConfig.weight_versions_kept).
    `keep` None keeps everything. The newest version, versions newer than it and files that are not
    `vNNNNNN.safetensors` (or its `.tmp`) are never touched; a file already gone is skipped.
    """
    if keep is None:
        return []
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (None = keep every version), got {keep}")
    oldest_kept = newest - keep + 1
    try:
        entries = list(Path(weights_dir).iterdir())
    except FileNotFoundError:
        return []
    deleted: list[Path] = []
    for path in sorted(entries):
        m = _VERSION_FILE.match(path.name)
        if m is None or int(m.group(1)) >= oldest_kept or (path.is_dir() and not path.is_symlink()):
            continue  # not a version file, a version kept, or a directory that happens to match
        try:
            path.unlink()
        except FileNotFoundError:
            continue  # already gone (deleted by hand or by an earlier prune): nothing to do
        deleted.append(path)
    if deleted:
        log.debug(
            "weights store %s: kept v%d..v%d, deleted %s",
            weights_dir,
            max(oldest_kept, 0),
            newest,
            ", ".join(p.name for p in deleted),
        )
    return deleted
