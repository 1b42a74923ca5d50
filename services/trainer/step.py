"""The one training-step code path: what every rank does with a micro-batch and at the end of a step.

    build_replica                    model, optimizer, reference model (kl_coef > 0), loss settings:
                                     precision (bf16 + fp32 masters), sharding, recompute from the config
    begin_step                       zero the gradients (rank 0 once per step)
    step_batch                       batch advantage normalisation, once over the whole step
    backward_micro (per micro-batch) loss of the shard -> backward, gradients accumulate
    finish_step                      clip the accumulated gradient -> optimizer step

The distributed trainer (services.trainer.loop.Trainer.train_step) runs these around its
boundaries and all-reduces (services.trainer.dp_group: rank 0 here, workers in worker_main);
`train_batch` runs them in one process with no boundary, as `examples/rl_loop.py` does. Both reach
the same gradient for the same batch and micro-batch budget (up to float summation order), because
they are the same functions in the same order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gyre.model import build_model
from services.trainer.batch import PackedBatch
from services.trainer.config import TrainerConfig
from services.trainer.loss import LossSettings, normalise_advantages, tree_loss
from services.trainer.recompute import enable_recompute
from services.trainer.sharded_optimizer import MasterAdamW

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def build_replica(
    cfg: TrainerConfig, device: str | torch.device = "cpu", seed: int = 0
) -> tuple[Any, Any, Any | None, LossSettings]:
    """Model, optimizer, reference model (only with kl_coef > 0) and loss settings of one replica.

    The weights are initialised (or loaded) in `cfg.dtype` first, so a bf16 run starts from the fp32
    run's weights: its masters are those weights and its compute copy their bf16 rounding. The
    optimizer is a plain AdamW for precision fp32 without sharding (today's exact path), else a
    MasterAdamW (sharded_optimizer.py). The reference model is a frozen copy of the initial
    weights, in bf16 unless `reference_precision` is `same`."""
    model = build_model(cfg.model, device=device, dtype=DTYPES[cfg.dtype], seed=seed)
    if cfg.init_weights:  # an HF checkpoint directory or a Gyre safetensors file
        from gyre.model.hf import load_initial_weights

        load_initial_weights(model, cfg.init_weights)
    ref_model = None
    if cfg.kl_coef > 0:  # a second build, not a deepcopy: Megatron's modules hold process groups
        ref_dtype = torch.bfloat16 if cfg.reference_precision == "bf16" else DTYPES[cfg.dtype]
        ref_model = build_model(cfg.model, device=device, dtype=ref_dtype, seed=seed).requires_grad_(False)
        with torch.no_grad():
            for ref_param, param in zip(ref_model.parameters(), model.parameters(), strict=True):
                ref_param.copy_(param)  # rounded to the reference's dtype
    if cfg.precision == "fp32" and cfg.optimizer_sharding == "none":
        optimizer: Any = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        master = DTYPES[cfg.dtype] if cfg.precision == "bf16" else None
        sharded = cfg.optimizer_sharding == "zero1"
        optimizer = MasterAdamW(
            model.parameters(), cfg.lr, cfg.weight_decay, master, sharded
        )  # masters first
        if master is not None:
            model.to(torch.bfloat16)  # in place: the optimizer's parameters are the compute copy
    enable_recompute(model, cfg.recompute_granularity == "full")
    return model, optimizer, ref_model, LossSettings.from_config(cfg)


def loss_dtype(model: Any, optimizer: Any) -> torch.dtype:
    """The dtype of a batch's float arrays (weights, behaviour log-probs): the masters' with bf16
    compute (the loss is taken in fp32), else the parameters'."""
    if isinstance(optimizer, MasterAdamW) and optimizer.master_dtype is not None:
        return optimizer.master_dtype
    return next(model.parameters()).dtype


def shard_loss_settings(settings: LossSettings) -> LossSettings:
    """The loss settings of a micro-batch shard: batch advantage normalisation is done once per step
    before the step is cut (`step_batch`), never per shard."""
    return dataclasses.replace(settings, normalise_advantages=False)


def begin_step(optimizer: Any) -> None:
    """Zero the gradients that the step's micro-batches then accumulate into (kept allocated)."""
    optimizer.zero_grad(set_to_none=False)


def step_batch(batch: PackedBatch, normalise: bool) -> tuple[PackedBatch, float | None]:
    """The step's batch as its micro-batches are cut from it: with `normalise`, its policy-gradient
    weights divided by the whole step's advantage RMS (returned; None without normalisation)."""
    if not normalise:
        return batch, None
    return normalise_advantages(batch)


def backward_micro(
    model: Any, shard: PackedBatch, settings: LossSettings, ref_model: Any | None
) -> dict[str, float]:
    """Backpropagate one micro-batch shard's loss, adding to the gradients already there.
    An empty shard adds nothing (its rank still takes part in the all-reduce)."""
    if shard.num_tokens == 0:
        return {"loss": 0.0, "num_tokens": 0.0, "num_trained_tokens": 0.0}
    model.train()
    loss, metrics = tree_loss(model, shard, settings, ref_model)
    loss.backward()
    return metrics


def finish_step(model: Any, optimizer: Any, grad_clip: float) -> float:
    """Clip the accumulated gradient and take the optimizer step; returns the pre-clip norm (0: no clip).
    A MasterAdamW clips its gradients, steps its shard and broadcasts the parameters (every rank)."""
    if isinstance(optimizer, MasterAdamW):
        return optimizer.step_and_clip(grad_clip)
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)) if grad_clip else 0.0
    optimizer.step()
    return norm


def combine_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Step metrics from shard metrics (every rank, every micro-batch): sums add up, ratio-like
    means are token-weighted, everything else (grad_norm: equal on every rank) is the first's."""
    out: dict[str, float] = {}
    for part in reversed(parts):  # the first part that has a key wins (rank 0's, if it has it)
        out.update(part)
    for key in ("loss", "num_tokens", "num_trained_tokens"):
        out[key] = sum(p.get(key, 0.0) for p in parts)
    total = out["num_trained_tokens"]
    for key in ("ratio_mean", "clip_fraction", "kl_mean", "kl_behaviour", "entropy"):
        have = [p for p in parts if key in p]
        if have and total:
            out[key] = sum(p[key] * p["num_trained_tokens"] for p in have) / total
    return out


def train_batch(
    model: Any,
    optimizer: Any,
    batch: PackedBatch,
    settings: LossSettings,
    ref_model: Any | None,
    grad_clip: float,
    micro_batch_tokens: int,
) -> dict[str, float]:
    """One optimizer step over `batch` in this process: the trainer's step with one rank and no
    boundary. `settings` as `build_replica` gives them (normalise_advantages applies to the step)."""
    param = next(model.parameters())
    batch, rms = step_batch(
        batch.to(param.device, loss_dtype(model, optimizer)), settings.normalise_advantages
    )
    shard_settings = shard_loss_settings(settings)
    begin_step(optimizer)
    micro_batches = batch.micro_batches(micro_batch_tokens)
    parts = [backward_micro(model, micro, shard_settings, ref_model) for micro in micro_batches]
    grad_norm = finish_step(model, optimizer, grad_clip)
    metrics = combine_metrics(parts)
    # tokens of ancestor context forwarded again because a tree was split (services/trainer/split_trees.py)
    metrics["recomputed_context_tokens"] = float(sum(m.num_tokens for m in micro_batches) - batch.num_tokens)
    if rms is not None:
        metrics["advantage_rms"] = rms
    if grad_clip:
        metrics["grad_norm"] = grad_norm
    return metrics
