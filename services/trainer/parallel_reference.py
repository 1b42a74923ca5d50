"""The loss and gradients of one packed batch under model parallelism, and the single-process
reference they are compared against (tests/trainer/test_tensor_parallel.py on gloo ranks,
services/trainer/parallel_check.py on GPUs for scripts/gpu_check.sh).

    reference_loss_and_grads   TP = CP = 1: the loss and every parameter's gradient, by name
    model_parallel_backward    one TP x CP rank: this rank's loss terms backpropagated, the
                               gradients then summed over the CP group (every CP rank holds the whole
                               batch's gradient of its TP shard)
    gathered_loss_and_grads    after it: the batch's loss (summed over CP) and full-shape gradients
                               (all-gathered over TP), the same on every rank
    relative_gaps              how far a (loss, gradients) pair is from the reference's

The model is one built by `gyre.model.build_model` under Megatron's parallel state
(`gyre.model.parallel.init_model_parallel`) with its shard of the reference's weights
(`gyre.model.tp_shard.load_full_weights`); the batch is the whole batch on every rank (each CP rank
trains the terms of its own tokens, `tree_loss` picks them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from services.trainer.batch import PackedBatch
from services.trainer.loss import LossSettings, tree_loss


def reference_loss_and_grads(
    model: Any, batch: PackedBatch, settings: LossSettings, ref_model: Any | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The single-process loss and every parameter's gradient (by name, detached copies). The
    model's gradients are None before and after."""
    model.zero_grad(set_to_none=True)
    loss, _ = tree_loss(model, batch, settings, ref_model)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def model_parallel_backward(
    model: Any, batch: PackedBatch, settings: LossSettings, ref_model: Any | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """One forward and backward of `batch` on this TP x CP rank (collective: every rank of the
    model's TP and CP groups calls it with the same batch).

    Gradients start from None; afterwards each parameter's gradient is the whole batch's gradient of
    this rank's shard (the CP ranks' partial gradients summed, `reduce_context_parallel_grads`).
    Returns this rank's loss (the terms of the tokens it owns: the whole loss when CP = 1) and its
    metrics (counting those tokens)."""
    from gyre.model.parallel import reduce_context_parallel_grads

    model.zero_grad(set_to_none=True)
    loss, metrics = tree_loss(model, batch, settings, ref_model)
    loss.backward()
    reduce_context_parallel_grads(model, model.gyre_parallel)
    return loss.detach(), metrics


def gathered_loss_and_grads(
    model: Any, local_loss: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The batch's loss (`local_loss` summed over the CP group) and every parameter's full gradient
    (split ones all-gathered over the TP group, `gyre.model.tp_shard.gather_full`), as copies, after
    `model_parallel_backward`. Collective over the TP and CP groups; the same result on every rank."""
    from gyre.model.tp_shard import gather_full

    layout = model.gyre_parallel
    loss = local_loss.detach().clone()
    if layout.cp_size > 1:
        dist.all_reduce(loss, group=layout.cp_group)
    grads = gather_full(model, {n: p.grad for n, p in model.named_parameters()})
    return loss, {n: g.detach().clone() for n, g in grads.items()}


def relative_gaps(
    expected_loss: torch.Tensor,
    expected_grads: dict[str, torch.Tensor],
    loss: torch.Tensor,
    grads: dict[str, torch.Tensor],
) -> tuple[float, float]:
    """(|loss / expected - 1|, the largest per-parameter ||grad - expected|| / ||expected||), in
    float64 whatever the dtypes (a parameter whose expected gradient is 0 counts its absolute
    ||grad||). Every expected parameter must be in `grads` (KeyError otherwise)."""
    loss_gap = float(abs(loss.double() / expected_loss.double() - 1))
    grad_gap = 0.0
    for name, expected in expected_grads.items():
        e = expected.double()
        diff, scale = float((grads[name].double() - e).norm()), float(e.norm())
        grad_gap = max(grad_gap, diff / scale if scale > 0 else diff)
    return loss_gap, grad_gap
