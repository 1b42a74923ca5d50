"""A MasterAdamW's optimizer state in torch.distributed.checkpoint (DCP) format: one shard per rank.

Layout: `<checkpoint>/optimizer/rank-RRRRR/` is a DCP checkpoint (`.metadata` + data files) of the
entries that rank held when the checkpoint was taken, keyed `<parameter name>/<entry key>` (entry
keys: `master`, `exp_avg`, `exp_avg_sq`, `step`). Every rank writes its own shard at the same time,
so no rank ever holds the whole state to save it; the shards are disjoint with ZeRO-1 and copies of
one another without sharding (then only rank 0 writes).

Restoring reads the shards' DCP metadata and loads, from whichever shard has it, every key the
restoring rank owns in *its* group: the group that saved need not be the group that restores (2
ranks saved, 1 restores, and vice versa). A restarted trainer restores as one rank (its workers join
later and receive their shards from rank 0, sharded_optimizer.py), so today rank 0 reads every key.

Why not DCP's collective save/load: the data-parallel group is rebuilt from a store at every resize
and is not a c10d world of its own (the process-wide default world is Megatron's), so each rank runs
DCP without collectives (`no_dist`) on its own shard directory and the re-sharding is done by key.
A rank on another host needs the checkpoint directory on a shared filesystem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from services.trainer.sharded_optimizer import MASTER, MasterAdamW


def trainable_names(model: Any) -> list[str]:
    """Names of the parameters a MasterAdamW holds, in its order (model.parameters() order)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def shard_dir(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank:05d}"


def save_shard(directory: Path, rank: int, model: Any, optimizer: MasterAdamW) -> Path:
    """Write this rank's entries as a DCP checkpoint under `directory`; returns the shard's path.
    Without sharding only rank 0 writes (every rank holds the same entries)."""
    path = shard_dir(directory, rank)
    if rank != 0 and not optimizer.sharded:
        return path
    names = trainable_names(model)
    state = {f"{names[i]}/{k}": v.detach() for i, e in optimizer.entries().items() for k, v in e.items()}
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def load_shards(directory: Path, model: Any, optimizer: MasterAdamW) -> None:
    """Restore the entries this rank owns (in its current group) from every shard under `directory`."""
    names = trainable_names(model)
    index = {name: i for i, name in enumerate(names)}
    owned = set(optimizer.owned())
    entries: dict[int, dict[str, torch.Tensor]] = {}
    shards = sorted(Path(directory).glob("rank-*"))
    if not shards:
        raise FileNotFoundError(f"no optimizer shard under {directory}")
    for path in shards:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        wanted: dict[str, torch.Tensor] = {}
        for key, meta in metadata.state_dict_metadata.items():
            name, _, entry_key = key.rpartition("/")
            if name not in index:
                raise ValueError(
                    f"optimizer shard {path} has state for {name!r}, which the model does not have"
                )
            if index[name] in owned and isinstance(meta, TensorStorageMetadata):
                wanted[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        if not wanted:
            continue
        dcp.load(wanted, checkpoint_id=str(path), no_dist=True)
        for key, tensor in wanted.items():
            name, _, entry_key = key.rpartition("/")
            entries.setdefault(index[name], {})[entry_key] = tensor
    missing = sorted(owned - set(entries)) if optimizer.master_dtype is not None else []
    if missing:
        raise ValueError(
            f"optimizer shards under {directory} lack parameters {[names[i] for i in missing][:5]}"
        )
    template = {
        k: str(v.dtype).removeprefix("torch.") for e in entries.values() for k, v in e.items() if k != MASTER
    }
    optimizer.load_state_dict({"format": "gyre-master-adamw", "template": template, "entries": entries})
