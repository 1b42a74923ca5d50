"""Checkpoints and the data cursor: what makes a restarted trainer train every batch exactly once.

A checkpoint directory `run_dir/trainer/checkpoints/step-NNNNNNNN/` holds model.safetensors,
the optimizer state and state.json (step, weight version, ids of every trained batch). The
optimizer state is optimizer.pt for a plain AdamW (trainer.precision fp32, no sharding), and for a
MasterAdamW (bf16 masters and/or ZeRO-1) the directory optimizer/ with one torch.distributed.checkpoint
shard per data-parallel rank (dist_checkpoint.py: every rank writes its own, and a group of any size
restores from it). It is written to a temporary directory and renamed, so a crash never leaves a
half checkpoint.

The journal `run_dir/trainer/journal.json` lists the batches pulled since the last checkpoint (in
order) and the highest weight version published. The trainer acks a batch to the trajectory
service only once a checkpoint covers it; after a crash it re-pulls the journal's batches by id
(`resume_batch_id`), retrains those the checkpoint does not cover, and publishes versions above
any it published before (so a version number never names two different files).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from gyre.model.weights import load_weights, save_weights
from services.trainer.dist_checkpoint import load_shards, save_shard
from services.trainer.sharded_optimizer import MasterAdamW

OptimizerWriter = Callable[[Path], None]  # writes every rank's optimizer shard into the directory given


@dataclass
class TrainState:
    step: int = 0
    version: int = 0
    trained_batch_ids: list[str] = field(default_factory=list)


@dataclass
class Journal:
    pulled_batch_ids: list[str] = field(default_factory=list)
    last_published_version: int = 0


class CheckpointStore:
    def __init__(self, run_dir: Path, keep: int = 2) -> None:
        self.root = Path(run_dir) / "trainer"
        self.dir = self.root / "checkpoints"
        self.keep = keep
        self.dir.mkdir(parents=True, exist_ok=True)

    def save(
        self, model: Any, optimizer: Any, state: TrainState, write_optimizer: OptimizerWriter | None = None
    ) -> Path:
        """Write a checkpoint of rank 0's model and state. A MasterAdamW's shards are written by
        `write_optimizer(dir)` (the data-parallel group: every rank its own), or by this rank alone."""
        final = self.dir / f"step-{state.step:08d}"
        tmp = self.dir / f".tmp-step-{state.step:08d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_weights(model, tmp / "model.safetensors")
        if isinstance(optimizer, MasterAdamW):
            if write_optimizer is None:
                save_shard(tmp / "optimizer", 0, model, optimizer)
            else:
                write_optimizer(tmp / "optimizer")
        else:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps(asdict(state)))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in self.list()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def list(self) -> list[Path]:
        return sorted(p for p in self.dir.glob("step-*") if (p / "state.json").is_file())

    def load_latest(self, model: Any, optimizer: Any) -> TrainState | None:
        """Restore the newest checkpoint into model/optimizer; None when there is none."""
        found = self.list()
        if not found:
            return None
        path = found[-1]
        load_weights(model, path / "model.safetensors")
        if isinstance(optimizer, MasterAdamW):
            if not (path / "optimizer").is_dir():
                raise ValueError(
                    f"checkpoint {path} holds a plain AdamW state (trainer.precision fp32, no sharding); "
                    "restore it with those settings"
                )
            load_shards(path / "optimizer", model, optimizer)
        else:
            if not (path / "optimizer.pt").is_file():
                raise ValueError(
                    f"checkpoint {path} holds bf16-master or sharded optimizer state; restore it with "
                    "the trainer.precision and trainer.optimizer_sharding it was written with"
                )
            optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        return TrainState(**json.loads((path / "state.json").read_text()))

    def read_journal(self) -> Journal:
        path = self.root / "journal.json"
        return Journal(**json.loads(path.read_text())) if path.is_file() else Journal()

    def write_journal(self, journal: Journal) -> None:
        path = self.root / "journal.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(journal)))
        os.replace(tmp, path)
