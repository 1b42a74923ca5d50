"""The trainer step of a `gyre bench xlong` point without the services, for a lent GPU
(`scripts/gpu_check.sh --xlong`): the point's group is built into a task tree, packed into
BatchChunks as the trajectory service packs them (services/trajectory/packing.py), rebuilt as the
trainer's PackedBatch and trained for one optimizer step with the trainer's own step
(services/trainer/step.py train_batch: micro-batches at the budget, tree parts with their context).
Advantages are the group's rewards minus their mean (the scoring itself is what the bench checks).
"""

from __future__ import annotations

import math
import time
from typing import Any

from gyre.model import ModelConfig, build_model
from services.trainer.batch import PackedBatch, from_chunks
from services.trainer.loss import LossSettings
from services.trainer.step import train_batch
from services.trajectory.packing import PackedExecution, ScoredGroup, pack
from services.trajectory.synthetic import LongConfig, long_executions
from services.trajectory.tree import TaskTree


def point_batch(context: int, group_size: int = 8, seed: int = 0) -> PackedBatch:
    """One group of `group_size` executions reaching `context` tokens, as the trainer receives it."""
    execs = long_executions(LongConfig(context_tokens=context, group_size=group_size, seed=seed))
    tree = TaskTree(execs[0].task_id)
    for ex in execs:
        for c in ex.calls():
            tree.insert_call(ex.execution_id, c.call_seq, c.prompt, c.completion, c.logprobs, c.versions)
    mean = sum(ex.reward for ex in execs) / len(execs)
    group = ScoredGroup(
        execs[0].group_id,
        execs[0].task_id,
        [PackedExecution(ex.execution_id, ex.reward - mean, 1, 1.0, ex.reward, 0) for ex in execs],
    )
    packed = pack({tree.task_id: tree}, [group], batch_id=f"xlong-{context}")
    return from_chunks(packed.chunks)


def train_point(
    batch: PackedBatch, model_cfg: ModelConfig, device: str, micro_batch_tokens: int
) -> dict[str, Any]:
    """One optimizer step over `batch` on `device`: seconds, loss, micro-batches and peak memory."""
    import torch

    torch.manual_seed(0)
    model = build_model(model_cfg, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    metrics = train_batch(model, optimizer, batch, LossSettings(), None, 1.0, micro_batch_tokens)
    if device == "cuda":
        torch.cuda.synchronize()
    micro = batch.micro_batches(micro_batch_tokens)
    return {
        "tokens": batch.num_tokens,
        "micro_batch_budget_tokens": micro_batch_tokens,
        "micro_batches": len(micro),
        "micro_batch_max_tokens": max(m.num_tokens for m in micro),
        "step_s": round(time.perf_counter() - t0, 2),
        "loss": metrics["loss"],
        "loss_finite": math.isfinite(metrics["loss"]),
        "recomputed_context_tokens": metrics.get("recomputed_context_tokens", 0.0),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
    }
