"""Chunked log-prob and entropy with the vocabulary split over the tensor-parallel ranks.

Under Megatron tensor parallelism the output layer (or the tied embedding) holds V / TP rows per
rank, rows [r V/TP, (r+1) V/TP) on rank r (Megatron's VocabUtility), so each rank computes logits
for its slice of the vocabulary only. Per chunk of C tokens (never T x V, never even C x V on one
rank: C x V/TP), with z the rank's logits (fp32 or wider):

    m    = max over ranks of max_k z_k                 (all-reduce MAX)
    S    = sum over ranks of sum_k exp(z_k - m)        \\
    z_y  = the target's logit, from the rank that owns y |  one all-reduce SUM of [S, z_y, E]
    E    = sum over ranks of sum_k exp(z_k - m) z_k    /
    lse = m + log S,  logprob = z_y - lse,  entropy = lse - E / S   (= -sum p log p)

Backward recomputes the rank's chunk logits (p_k = exp(z_k - lse), from the lse saved per token) and
forms the same logits gradient as services/trainer/chunked_softmax.py on its vocabulary slice:

    dz = g * (onehot(y) - p) - h * p * (log p + entropy)

dW for the rank's rows is local (dz^T hidden); dhidden = dz @ W is a partial sum over the vocabulary
slices, summed by Megatron's `copy_to_tensor_model_parallel_region` (identity forward, all-reduce
backward) on the hidden states, exactly as Megatron's ColumnParallelLinear does with its input. Every
rank ends with the same log-probs and entropies, so the rest of the loss runs replicated. Equal to
the TP = 1 computation up to float summation order (tests/trainer/test_tensor_parallel.py, float64).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """(hidden [N, H], weight shard [V/TP, H], targets [N] global ids) -> (logprob [N], entropy [N])."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_tokens: int,
        vocab_start: int,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_dtype = torch.promote_types(hidden.dtype, torch.float32)
        n, v_local = hidden.shape[0], weight.shape[0]
        logprob = torch.empty(n, dtype=out_dtype, device=hidden.device)
        entropy = torch.empty_like(logprob)
        lse = torch.empty_like(logprob)
        local_target = targets - vocab_start
        owned = (local_target >= 0) & (local_target < v_local)
        with torch.no_grad():
            for start in range(0, n, chunk_tokens):
                stop = start + chunk_tokens
                z = (hidden[start:stop] @ weight.t()).to(out_dtype)
                m = z.max(dim=-1).values
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
                e = torch.exp(z - m[:, None])
                zy = z.gather(-1, local_target[start:stop].clamp(0, v_local - 1)[:, None])[:, 0]
                zy = torch.where(owned[start:stop], zy, torch.zeros_like(zy))
                sums = torch.stack([e.sum(-1), zy, (e * z).sum(-1)])
                dist.all_reduce(sums, group=group)
                lse[start:stop] = m + sums[0].log()
                logprob[start:stop] = sums[1] - lse[start:stop]
                entropy[start:stop] = lse[start:stop] - sums[2] / sums[0]
        ctx.save_for_backward(hidden, weight, local_target, owned, lse, entropy)
        ctx.chunk_tokens = chunk_tokens
        return logprob, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, local_target, owned, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        v_local = weight.shape[0]
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            stop = start + ctx.chunk_tokens
            h = hidden[start:stop]
            logp = (h @ weight.t()).to(lse.dtype) - lse[start:stop, None]
            p = logp.exp()
            dz = torch.zeros_like(logp)
            if grad_logprob is not None:
                g = grad_logprob[start:stop, None].to(dz.dtype)
                dz -= g * p
                mine = owned[start:stop, None]
                dz.scatter_add_(
                    -1,
                    local_target[start:stop, None].clamp(0, v_local - 1),
                    torch.where(mine, g, torch.zeros_like(g)),
                )
            if grad_entropy is not None:
                e = grad_entropy[start:stop, None].to(dz.dtype)
                dz -= e * p * (logp + entropy[start:stop, None])
            if grad_hidden is not None:
                grad_hidden[start:stop] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += dz.t().to(acc) @ h.to(acc)
        grad_w = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_w, None, None, None, None


def vocab_parallel_logprob_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    tp_rank: int,
    tp_group: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets[t] | hidden[t]) [N] and the entropy (nats) [N], identical on every TP rank, from
    hidden states [N, H] (the same on every rank) and this rank's output-weight rows
    `weight_shard` [V/TP, H] (Megatron's vocabulary split: rank r holds rows r*V/TP ...). At most
    `chunk_tokens` x V/TP logits exist on a rank at a time, forward or backward; fp32 results (fp64
    for fp64 inputs). Collectives: two all-reduces per chunk forward, one on the hidden gradient."""
    from gyre.model.megatron import quiet_megatron_import

    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    quiet_megatron_import()
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    vocab_start = tp_rank * weight_shard.shape[0]
    out: tuple[torch.Tensor, torch.Tensor] = _VocabParallelLogprobEntropy.apply(
        hidden, weight_shard, targets.long(), chunk_tokens, vocab_start, tp_group
    )
    return out
