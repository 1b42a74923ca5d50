"""The policy-gradient loss over a tree-packed batch.

Per token t of a path p with importance ratio r_t = exp(logp_t - behaviour_logp_t) and path
weight w_p = advantage_p * norm_p, the PPO-clipped objective is
    -min(r_t * A_p, clip(r_t, 1 - eps, 1 + eps) * A_p) * norm_p
  = w_p * l+(r_t)  if w_p >= 0, with l+(r) = -min(r, clip(r))
  = w_p * l-(r_t)  if w_p <  0, with l-(r) = -max(r, clip(r)).
r_t depends only on t's ancestors, so it is the same on every path through t, and summing over
paths gives  sum_t weight_pos_t * l+(r_t) + weight_neg_t * l-(r_t)  (+ kl_coef * kl_weight_t * kl_t):
exactly the loss — and gradient — of training each path as its own sample (tested in float64).
The importance ratio corrects tokens sampled by older weights (staleness).
KL to a reference model uses the k3 estimator exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased).
The loss is a sum over tokens (the trajectory service's weights carry the normalisation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gyre.model.attention import TreeLayout
from gyre.model.forward import hidden_states, logprobs_of, predecessor_index
from services.trainer.batch import PackedBatch


@dataclass(frozen=True)
class LossSettings:
    clip_eps: float = 0.2
    kl_coef: float = 0.0


def clipped_token_losses(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    weight_pos: torch.Tensor,
    weight_neg: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weighted clipped losses [T] (0 where loss_mask is 0) and the ratios [T]."""
    ratio = torch.exp(torch.where(loss_mask, logprobs - behaviour_logprobs, torch.zeros_like(logprobs)))
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    loss_pos = -torch.minimum(ratio, clipped)
    loss_neg = -torch.maximum(ratio, clipped)
    per_token = weight_pos * loss_pos + weight_neg * loss_neg
    return torch.where(loss_mask, per_token, torch.zeros_like(per_token)), ratio


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate, k3 form."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def batch_logprobs(model: Any, batch: PackedBatch) -> torch.Tensor:
    """log p(token_t | ancestors) [T] for a packed batch under `model`."""
    layout = TreeLayout(batch.num_tokens, batch.node_offsets, batch.node_lengths, batch.node_parents)
    hidden = hidden_states(model, batch.token_ids[None], batch.position_ids[None], layout)[0]
    return logprobs_of(model, hidden, batch.token_ids, predecessor_index(layout).to(batch.token_ids.device))


def tree_loss(
    model: Any, batch: PackedBatch, settings: LossSettings, ref_model: Any | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss (a scalar to backpropagate) and metrics of one packed batch (or a shard of one)."""
    if batch.num_tokens == 0:
        zero = sum(p.sum() * 0.0 for p in model.parameters())
        return zero, {"loss": 0.0, "num_tokens": 0.0, "num_trained_tokens": 0.0}
    logprobs = batch_logprobs(model, batch)
    per_token, ratio = clipped_token_losses(
        logprobs,
        batch.behaviour_logprobs,
        batch.weight_pos,
        batch.weight_neg,
        batch.loss_mask,
        settings.clip_eps,
    )
    loss = per_token.sum()
    mask = batch.loss_mask
    n_train = int(mask.sum())
    metrics = {
        "num_tokens": float(batch.num_tokens),
        "num_trained_tokens": float(n_train),
    }
    if settings.kl_coef and ref_model is not None:
        with torch.no_grad():
            ref = batch_logprobs(ref_model, batch)
        kl = torch.where(mask, k3_kl(logprobs, ref), torch.zeros_like(logprobs))
        loss = loss + settings.kl_coef * (batch.kl_weight * kl).sum()
        metrics["kl_mean"] = float(kl.sum()) / max(n_train, 1)
    with torch.no_grad():
        if n_train:
            r = ratio[mask]
            metrics["ratio_mean"] = float(r.mean())
            metrics["clip_fraction"] = float(((r - 1.0).abs() > settings.clip_eps).double().mean())
    metrics["loss"] = float(loss.detach())
    return loss, metrics
