"""KV-cache incremental decoding for the rollout torch engine.

One `KVCache` per sequence (per layer: keys/values [kv_heads, capacity, head_dim], grown by
doubling). `prefill` appends any number of tokens to one sequence's cache (a new prompt, a
chunk of one, or a migrated request's prompt + generated tokens); `decode_step` advances a batch
of sequences of different lengths by one token each. Dropping a sequence = dropping its cache;
`truncate` rolls a cache back. Results equal the uncached forward (tested: greedy decoding with
and without the cache produce the same tokens). Runs under `torch.no_grad()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gyre.errors import InvalidArgument
from gyre.model.attention import DenseMask, pad_stack
from gyre.model.forward import hidden_states, logits_from_hidden


class KVCache:
    """Keys and values of one sequence for every layer, plus its length in tokens."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def clear(self) -> None:
        """Forget every token (the sequence must be prefilled again)."""
        self.keys, self.values, self.length = [], [], 0

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens (e.g. to roll back a rejected suffix)."""
        if not 0 <= length <= self.length:
            raise InvalidArgument(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Write k/v [Hkv, n, d] at [start, start + n) of `layer` (growing the buffers as needed)."""
        n = k.shape[1]
        if layer == len(self.keys):
            cap = max(16, n)
            self.keys.append(k.new_zeros(k.shape[0], cap, k.shape[2]))
            self.values.append(v.new_zeros(v.shape[0], cap, v.shape[2]))
        if start + n > self.keys[layer].shape[1]:
            cap = max(2 * self.keys[layer].shape[1], start + n)
            for store in (self.keys, self.values):
                grown = store[layer].new_zeros(store[layer].shape[0], cap, store[layer].shape[2])
                grown[:, :start] = store[layer][:, :start]
                store[layer] = grown
        self.keys[layer][:, start : start + n] = k
        self.values[layer][:, start : start + n] = v

    def layer_view(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer][:, :length], self.values[layer][:, :length]


def _check(ids: torch.Tensor, positions: torch.Tensor) -> None:
    if ids.dim() != 1 or ids.shape != positions.shape:
        raise InvalidArgument(
            f"need 1-D token ids and positions of one length, got {tuple(ids.shape)}, {tuple(positions.shape)}"
        )


@torch.no_grad()
def prefill(model: Any, cache: KVCache, token_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Append tokens [T] (with their position ids [T]) to `cache`; return their logits [T, V]."""
    _check(token_ids, position_ids)
    start, n = cache.length, token_ids.shape[0]
    if n == 0:
        raise InvalidArgument("prefill needs at least one token")

    def hook(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache._append(layer, k[0], v[0], start)
        ks, vs = cache.layer_view(layer, start + n)
        return ks[None], vs[None]

    mask = None
    if start:
        dev = token_ids.device
        allowed = torch.arange(start + n, device=dev)[None, :] <= start + torch.arange(n, device=dev)[:, None]
        mask = DenseMask(allowed[None, None])
    hidden = hidden_states(model, token_ids[None], position_ids[None], mask, hook)
    cache.length = start + n
    return logits_from_hidden(model, hidden[0])


@torch.no_grad()
def decode_step(
    model: Any, caches: Sequence[KVCache], next_token_ids: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Feed one token to each sequence (caches may differ in length); return logits [B, V].

    Each cache grows by one. A cache must have been prefilled (length >= 1) or be empty.
    """
    _check(next_token_ids, positions)
    if len(caches) != next_token_ids.shape[0]:
        raise InvalidArgument(f"{len(caches)} caches but {next_token_ids.shape[0]} tokens")
    starts = [c.length for c in caches]
    longest = max(starts) + 1

    def hook(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for b, c in enumerate(caches):
            c._append(layer, k[b], v[b, :, :], starts[b])
        views = [c.layer_view(layer, starts[b] + 1) for b, c in enumerate(caches)]
        return pad_stack([kv[0] for kv in views], longest), pad_stack([kv[1] for kv in views], longest)

    dev = next_token_ids.device
    lens = torch.tensor(starts, device=dev) + 1
    allowed = torch.arange(longest, device=dev)[None, :] < lens[:, None]
    hidden = hidden_states(
        model, next_token_ids[:, None], positions[:, None], DenseMask(allowed[:, None, None]), hook
    )
    for b, c in enumerate(caches):
        c.length = starts[b] + 1
    return logits_from_hidden(model, hidden[:, 0])


@torch.no_grad()
def greedy_generate(
    model: Any, prompt_ids: Sequence[int], max_new_tokens: int, use_cache: bool = True
) -> list[int]:
    """Greedy continuation of one prompt (positions 0..); with or without the KV cache."""
    from gyre.model.forward import causal_logits

    device = next(model.parameters()).device
    ids = list(prompt_ids)
    if not use_cache:
        for _ in range(max_new_tokens):
            logits = causal_logits(model, torch.tensor([ids], device=device))
            ids.append(int(logits[0, -1].argmax()))
        return ids[len(prompt_ids) :]
    cache = KVCache()
    logits = prefill(model, cache, torch.tensor(ids, device=device), torch.arange(len(ids), device=device))
    nxt = int(logits[-1].argmax())
    out = [nxt]
    while len(out) < max_new_tokens:
        pos = torch.tensor([len(ids) + len(out) - 1], device=device)
        logits = decode_step(model, [cache], torch.tensor([nxt], device=device), pos)
        nxt = int(logits[0].argmax())
        out.append(nxt)
    return out
