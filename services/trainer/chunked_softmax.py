"""Log-prob of the sampled token and entropy of the next-token distribution, a few tokens at a time.

The full computation materialises logits, log-softmax and their product for every token at once:
T x V floats each (at T = 32K tokens and a 152K vocabulary, 20 GB per fp32 copy). Here the tokens
are processed in chunks of `chunk_tokens`: forward keeps only the per-token results, and backward
recomputes each chunk's logits from the hidden states and the output weight (one extra output-layer
matmul per chunk) and turns them into that chunk's gradient at once. The peak is one chunk's
C x V logits plus its softmax, never T x V.

Per token t with logits z (fp32), p = softmax(z), target y:
    logprob_t = z_y - logsumexp(z)                d/dz = onehot(y) - p
    entropy_t = -sum_k p_k log p_k                d/dz_k = -p_k (log p_k + entropy_t)
so for upstream gradients g (logprob) and h (entropy) the logits' gradient is
    dz = g * (onehot(y) - p) - h * p * (log p + entropy)
and dhidden = dz @ W, dW = dz^T @ hidden (in the weight's dtype, accumulated in fp32 for bf16).
Equal to the full computation up to float summation order (tests/trainer/test_chunked_softmax.py:
float64 values and gradients, rtol 1e-6).
"""

from __future__ import annotations

from typing import Any

import torch


def _chunk_stats(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log-softmax [C, V] (fp32 or wider), log-prob of the targets [C], entropy [C] of one chunk."""
    logits = hidden @ weight.t()
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, targets[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return logp, picked, entropy


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """Autograd function: (hidden [N, H], weight [V, H], targets [N]) -> (logprob [N], entropy [N])."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_dtype = torch.promote_types(hidden.dtype, torch.float32)
        logprob = torch.empty(hidden.shape[0], dtype=out_dtype, device=hidden.device)
        entropy = torch.empty_like(logprob)
        with torch.no_grad():
            for start in range(0, hidden.shape[0], chunk_tokens):
                stop = start + chunk_tokens
                _, logprob[start:stop], entropy[start:stop] = _chunk_stats(
                    hidden[start:stop], weight, targets[start:stop]
                )
        ctx.save_for_backward(hidden, weight, targets, entropy)
        ctx.chunk_tokens = chunk_tokens
        return logprob, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, targets, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            stop = start + ctx.chunk_tokens
            h = hidden[start:stop]
            logp, _, _ = _chunk_stats(h, weight, targets[start:stop])
            p = logp.exp()
            dz = torch.zeros_like(logp)
            if grad_logprob is not None:
                g = grad_logprob[start:stop, None].to(dz.dtype)
                dz -= g * p
                dz.scatter_add_(-1, targets[start:stop, None], g)
            if grad_entropy is not None:
                e = grad_entropy[start:stop, None].to(dz.dtype)
                dz -= e * p * (logp + entropy[start:stop, None])
            if grad_hidden is not None:
                grad_hidden[start:stop] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += dz.t().to(acc) @ h.to(acc)
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


def chunked_logprob_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets[t] | hidden[t]) [N] and the entropy (nats) of that distribution [N], in fp32
    (fp64 for fp64 inputs), from hidden states [N, H] and the output weight [V, H] (logits =
    hidden @ weight^T, no bias). At most `chunk_tokens` x V logits exist at any time, forward or
    backward; values and gradients equal the full computation's."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    out: tuple[torch.Tensor, torch.Tensor] = _ChunkedLogprobEntropy.apply(
        hidden, weight, targets.long(), chunk_tokens
    )
    return out


def full_logprob_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same numbers by plain autograd over all N x V logits at once (the reference and the
    bench's baseline; never used for training)."""
    _, picked, entropy = _chunk_stats(hidden, weight, targets.long())
    return picked, entropy
