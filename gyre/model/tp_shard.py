"""Full (TP = 1) tensors <-> one tensor-parallel rank's shards of them, by the model's own metadata.

Megatron marks every split parameter with `tensor_model_parallel = True` and its `partition_dim`
(0 for ColumnParallelLinear and VocabParallelEmbedding rows, 1 for RowParallelLinear columns); the
others (norms, row-parallel biases, learned positions) are replicated. Two layouts need more than a
contiguous cut, and both are handled here:

- the fused q/k/v weight is laid out per query group ([q heads of group 0, k0, v0 | group 1 ...]),
  so a contiguous cut gives each rank whole groups: correct when TP divides the key/value heads
  (`gyre.model.build.check_tensor_parallel` requires it);
- the gated MLP's fc1 (`swiglu`) stacks [gate; up] and each rank computes act(gate_r) * up_r on its
  own half, so rank r holds [gate chunk r; up chunk r], not chunk r of the stack.

`load_full_weights` builds a TP replica from full weights (a checkpoint, the trainer's published
state, a TP = 1 model's); `gather_full` is the inverse (for parameters or their gradients), an
all-gather over the TP group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from gyre.errors import InvalidArgument
from gyre.model.build import model_config_of
from gyre.model.parallel import ModelParallel


def _parallel_of(model: Any) -> ModelParallel:
    mp = getattr(model, "gyre_parallel", None)
    return mp if isinstance(mp, ModelParallel) else ModelParallel()


def _split_dim(param: torch.Tensor) -> int | None:
    """The dimension a parameter is split along over the TP group, None when it is replicated."""
    if getattr(param, "tensor_model_parallel", False):
        return int(getattr(param, "partition_dim", 0))
    return None


def _is_glu_fc1(model: Any, name: str) -> bool:
    return model_config_of(model).swiglu and ".mlp.linear_fc1." in name


def shard_of(model: Any, name: str, full: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Rank `tp_rank`'s shard of parameter `name`'s full tensor (the tensor itself when replicated)."""
    param = dict(model.named_parameters())[name]
    dim = _split_dim(param)
    if dim is None or tp_size == 1:
        return full
    if _is_glu_fc1(model, name):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat(
            [gate.chunk(tp_size, dim=dim)[tp_rank], up.chunk(tp_size, dim=dim)[tp_rank]], dim=dim
        )
    if full.shape[dim] % tp_size:
        raise InvalidArgument(
            f"{name}: dimension {dim} of {tuple(full.shape)} does not split over {tp_size} ranks"
        )
    return full.chunk(tp_size, dim=dim)[tp_rank]


def load_full_weights(model: Any, full: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's shard of every full tensor into `model` (any TP size, TP = 1 included).

    InvalidArgument when a parameter is missing from `full`, a name is unknown, or a shard's shape
    differs from the parameter's; values are converted to the parameter's dtype and device."""
    mp = _parallel_of(model)
    params = dict(model.named_parameters())
    unknown = sorted(set(full) - set(params))
    missing = sorted(set(params) - set(full))
    if unknown or missing:
        raise InvalidArgument(
            f"full weights do not match the model: missing {missing[:5]}, unknown {unknown[:5]}"
        )
    with torch.no_grad():
        for name, param in params.items():
            shard = shard_of(model, name, full[name], mp.tp_size, mp.tp_rank)
            if shard.shape != param.shape:
                raise InvalidArgument(
                    f"{name}: shard {tuple(shard.shape)} of {tuple(full[name].shape)} != parameter "
                    f"{tuple(param.shape)} (TP {mp.tp_size})"
                )
            param.copy_(shard)


def gather_full(model: Any, named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors from this rank's shards `named` (parameter name -> shard-shaped tensor: the
    parameters themselves or their gradients): split ones are all-gathered over the TP group and
    reassembled (the inverse of `shard_of`), replicated ones returned as they are. Every TP rank
    must call it with the same names (collective)."""
    mp = _parallel_of(model)
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for name, shard in named.items():
        dim = _split_dim(params[name])
        if dim is None or mp.tp_size == 1:
            out[name] = shard
            continue
        pieces = [torch.empty_like(shard) for _ in range(mp.tp_size)]
        dist.all_gather(pieces, shard.contiguous(), group=mp.tp_group)
        if _is_glu_fc1(model, name):
            halves = [p.chunk(2, dim=dim) for p in pieces]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
        else:
            out[name] = torch.cat(pieces, dim=dim)
    return out
