"""Sampling that depends only on (logits, params, seed, absolute token index).

Each token's randomness is one uniform number drawn from a generator seeded by a hash of
(seed, absolute index), so a generation cut after k tokens and resumed elsewhere with
token_offset = k draws the same numbers as if it had never moved. Log-probs are those of the
distribution actually sampled from (temperature-scaled and top-p-renormalised); greedy reports
the log-softmax of the raw logits.
"""

from __future__ import annotations

import hashlib

import torch

from .base import Sampling


def token_uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) determined by (seed, index) alone."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def sample_token(logits: torch.Tensor, sampling: Sampling, index: int) -> tuple[int, float]:
    """Pick one token from logits [V] (any device); returns (token id, natural-log probability)."""
    logits = logits.float()
    if sampling.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = int(torch.argmax(logp))
        return tok, float(logp[tok])
    logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
    probs = logp.exp()
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < sampling.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
        logp = torch.log(probs)
    cdf = torch.cumsum(probs, 0).cpu()
    u = token_uniform(sampling.seed, index) * float(cdf[-1])
    tok = min(int(torch.searchsorted(cdf, torch.tensor([u]), right=True)[0]), probs.numel() - 1)
    while float(probs[tok]) == 0.0 and tok > 0:  # never land on a masked token at the edge
        tok -= 1
    return tok, float(logp[tok])
