"""The weights store keeps the newest versions only: services/trainer/weights_store.py.

The trainer loop runs in-process on the tiny default CPU model, fed synthetic tree-packed batches by
a stand-in for the trajectory service (the outermost edge), which also looks at the store each time
the loop pulls its next batch — that is, after the previous version was published and pruned.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from gyre.model import load_weights
from services.trainer.batch import PackedBatch
from services.trainer.config import TrainerConfig
from services.trainer.loop import Trainer
from services.trainer.weights_store import prune_versions, stored_versions, version_path
from tests.trainer.helpers import random_batch

NUM_VERSIONS = 50


class StoreWatchingSource:
    """Serves prepared batches in order and records the versions on disk at every pull."""

    def __init__(self, weights_dir: Path, num_batches: int, first: int = 0) -> None:
        self.weights_dir = weights_dir
        self.batches = [random_batch(first + i, batch_id=f"b{first + i}") for i in range(num_batches)]
        self.seen: list[tuple[int, list[int], list[str]]] = []  # (last published, versions, file names)

    async def pull(self, current_version: int, resume_batch_id: str = "") -> PackedBatch | None:
        names = sorted(p.name for p in self.weights_dir.iterdir()) if self.weights_dir.exists() else []
        self.seen.append((current_version, stored_versions(self.weights_dir), names))
        return self.batches.pop(0) if self.batches else None

    async def ack(self, batch_id: str, version: int) -> None:
        pass


def _config(**overrides) -> TrainerConfig:
    return TrainerConfig(device="cpu", lr=1e-2, checkpoint_every=1000, pull_wait_s=0, **overrides)


async def _train(cfg: TrainerConfig, run_dir: Path, steps: int, first_batch: int = 0):
    """Train `steps` more steps (batches b<first_batch>...) in `run_dir`, restoring what is there."""
    published = []

    async def sink(weights, metrics):
        published.append(weights)

    source = StoreWatchingSource(run_dir / "weights", steps, first_batch)
    trainer = Trainer(cfg, run_dir, source, sink, seed=0)
    try:
        await trainer.run(max_steps=trainer.state.step + steps)
    finally:
        trainer.close()
    source.seen.append(
        (
            trainer.journal.last_published_version,
            stored_versions(run_dir / "weights"),
            sorted(p.name for p in (run_dir / "weights").iterdir()),
        )
    )
    return trainer, source, published


async def test_after_every_one_of_fifty_publishes_only_the_newest_versions_the_staleness_bound_needs_stay(
    tmp_path,
):
    cfg = _config()
    keep = cfg.max_staleness + 2
    assert cfg.keep_weight_versions is None and cfg.weight_versions_kept == keep

    trainer, source, published = await _train(cfg, tmp_path, NUM_VERSIONS)

    assert [w.version for w in published] == list(range(1, NUM_VERSIONS + 1))
    after_publishes = [(v, versions, names) for v, versions, names in source.seen if v >= 1]
    assert [v for v, _, _ in after_publishes] == list(range(1, NUM_VERSIONS + 1))
    for newest, versions, names in after_publishes:
        assert len(versions) <= cfg.max_staleness + 2
        assert versions == list(range(max(1, newest - keep + 1), newest + 1))
        assert names == [version_path(Path(), v).name for v in versions]  # no leftovers, no sidecars
    print(f"versions on disk after each publish: {sorted({len(v) for _, v, _ in after_publishes})}")

    final = published[-1]
    assert final.uri == version_path(tmp_path / "weights", NUM_VERSIONS).resolve().as_uri()
    load_weights(trainer.model, final.uri.removeprefix("file://"), expected_sha256=final.sha256)


async def test_a_restarted_trainer_prunes_the_versions_an_earlier_run_kept(tmp_path):
    first_cfg = _config(keep_weight_versions=0).model_copy(update={"checkpoint_every": 8})
    await _train(first_cfg, tmp_path, 8)
    assert stored_versions(tmp_path / "weights") == list(range(1, 9))  # 0 = every version kept

    cfg = _config(max_staleness=1)  # keeps max_staleness + 2 = 3
    restarted, _, second = await _train(cfg, tmp_path, 1, first_batch=8)

    assert restarted.state.step == 9 and [w.version for w in second] == [9]
    assert stored_versions(tmp_path / "weights") == [7, 8, 9]


def test_prune_versions_deletes_only_old_version_files_and_their_leftover_temp_files(tmp_path, caplog):
    for v in range(1, 11):
        version_path(tmp_path, v).write_bytes(b"w")
    version_path(tmp_path, 12).write_bytes(b"newer than the newest")
    (tmp_path / "v000003.safetensors.tmp").write_bytes(b"a crashed write")
    unrelated = ["notes.txt", "model.safetensors", "v1.safetensors", "x000001.safetensors", "v000002.json"]
    for name in unrelated:
        (tmp_path / name).write_text("not a version")
    (tmp_path / "v000001.safetensors.d").mkdir()
    (tmp_path / "old").mkdir()
    version_path(tmp_path / "old", 1).write_bytes(b"w")

    with caplog.at_level(logging.DEBUG, logger="gyre.trainer.weights"):
        deleted = prune_versions(tmp_path, newest=10, keep=3)

    assert sorted(p.name for p in deleted) == sorted(
        [version_path(Path(), v).name for v in range(1, 8)] + ["v000003.safetensors.tmp"]
    )
    assert stored_versions(tmp_path) == [8, 9, 10, 12]
    assert all((tmp_path / name).read_text() == "not a version" for name in unrelated)
    assert (tmp_path / "v000001.safetensors.d").is_dir() and version_path(tmp_path / "old", 1).exists()
    assert "v000007.safetensors" in caplog.text and "deleted" in caplog.text
    assert prune_versions(tmp_path, newest=10, keep=3) == []  # nothing left to delete


def test_prune_versions_never_deletes_the_newest_and_keeps_everything_when_told_to(tmp_path):
    for v in range(1, 4):
        version_path(tmp_path, v).write_bytes(b"w")

    assert prune_versions(tmp_path, newest=3, keep=None) == []
    assert stored_versions(tmp_path) == [1, 2, 3]
    prune_versions(tmp_path, newest=3, keep=1)
    assert stored_versions(tmp_path) == [3]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune_versions(tmp_path, newest=3, keep=0)
    assert prune_versions(tmp_path / "no-store-yet", newest=1, keep=1) == []


def test_prune_versions_skips_a_file_that_is_already_gone(tmp_path, monkeypatch):
    for v in range(1, 5):
        version_path(tmp_path, v).write_bytes(b"w")
    listed = list(tmp_path.iterdir())
    version_path(tmp_path, 1).unlink()  # deleted by someone else between the listing and the prune
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(listed))

    deleted = prune_versions(tmp_path, newest=4, keep=2)

    assert sorted(p.name for p in deleted) == ["v000002.safetensors"]
    monkeypatch.undo()
    assert stored_versions(tmp_path) == [3, 4]


def test_the_number_of_kept_versions_defaults_to_the_staleness_bound_plus_two_and_cannot_undercut_it():
    assert _config(max_staleness=2).weight_versions_kept == 4
    assert _config(keep_weight_versions=0).weight_versions_kept is None
    assert _config(max_staleness=2, keep_weight_versions=3).weight_versions_kept == 3
    with pytest.raises(ValidationError, match="keep at least max_staleness \\+ 1 = 3"):
        _config(max_staleness=2, keep_weight_versions=2)
    with pytest.raises(ValidationError):
        _config(keep_weight_versions=-1)
