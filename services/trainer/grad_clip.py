"""Gradient clipping to the whole model's norm when the model is split over a tensor-parallel group.

Under Megatron tensor parallelism a parameter is either *split* (its `tensor_model_parallel`
attribute is true: column/row-parallel weights, vocabulary-parallel embedding and output layer; each
TP rank holds a disjoint part) or *replicated* (norms, row-parallel biases, learned positions: every TP
rank holds the same values and, after the step's reductions, the same gradient). The whole model's
squared norm is therefore the split parameters' squares summed over the TP group plus the replicated
parameters' squares counted once.

Used by the plain-AdamW TP replicas (`tp_replica.clip_tensor_parallel`) and by `MasterAdamW` when it is
given a TP group, so both clip with the same arithmetic: squares accumulated in float64, one
all-reduce of one scalar over the TP group, then `torch.nn.utils.clip_grad_norm_`'s coefficient
min(1, clip / (norm + 1e-6)) applied in place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def is_split(param: torch.Tensor) -> bool:
    """Whether each TP rank holds its own part of `param` (Megatron's `tensor_model_parallel`)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def clip_over_tensor_parallel(
    split: Sequence[torch.Tensor], replicated: Sequence[torch.Tensor], grad_clip: float, tp_group: Any
) -> float:
    """Clip the gradients `split` (this TP rank's parts of split parameters) and `replicated` (equal on
    every TP rank) in place to the whole model's norm `grad_clip` (0: no clipping, nothing is reduced)
    and return the pre-clip norm (0.0 when not clipping). Every TP rank calls it (a collective)."""
    if not grad_clip:
        return 0.0
    zero = torch.zeros((), dtype=torch.float64)
    split_sq = sum((g.detach().double().pow(2).sum() for g in split), zero)
    dist.all_reduce(split_sq, group=tp_group)
    replicated_sq = sum((g.detach().double().pow(2).sum() for g in replicated), zero)
    norm = math.sqrt(float(split_sq + replicated_sq))
    coef = min(1.0, grad_clip / (norm + 1e-6))
    if coef < 1.0:
        with torch.no_grad():
            for g in [*split, *replicated]:
                g.mul_(coef)
    return norm
