"""The shared model: a megatron-core GPT that the trainer trains and the torch engine serves.

API summary (everything takes and returns torch tensors on the model's device):

    from gyre.model import ModelConfig, build_model
    cfg = ModelConfig()                                  # tiny CPU defaults, vocab 512 (byte tokenizer)
    model = build_model(cfg, device="cpu", dtype=torch.float32, seed=0)   # megatron GPTModel

    # Training / scoring (trainer)
    tree_logits(model, token_ids[T], position_ids[T], node_offsets, node_lengths, node_parents) -> [T, V]
    tree_logprobs(model, ...same...) -> [T]      # log p(token_t | ancestors); 0 for a root's first token
    causal_logits(model, token_ids[B, S], position_ids[B, S] | None, lengths | None) -> [B, S, V]

    # Incremental decoding (rollout torch engine); one KVCache per sequence
    cache = KVCache()
    logits = prefill(model, cache, token_ids[T], position_ids[T])          # -> [T, V], cache grows by T
    logits = decode_step(model, [c1, c2, ...], next_ids[B], positions[B])  # -> [B, V], each cache +1
    cache.clear() / cache.truncate(n) / len(cache)   # migration: drop and re-prefill prompt + generated
    greedy_generate(model, prompt_ids, max_new_tokens, use_cache=True) -> list[int]

    # Tensor / context parallelism (docs/trainer.md, "Parallelism"), after torch.distributed is initialised
    init_model_parallel(tp, cp)                     # Megatron's parallel state; build_model then shards layers
    load_full_weights(model, full_state)            # a TP rank's shard of full (TP = 1) weights

    # Weights
    sha = save_weights(model, path)                 # safetensors, atomic; returns hex sha256
    load_weights(model, path, expected_sha256=sha)  # InvalidArgument on a digest or shape mismatch

Position ids are explicit everywhere (RoPE is computed from them, not from the sequence index),
so a tree-packed token, a cached token and an uncached token at the same position see the same
rotation. Importing `gyre.model` is light; torch and megatron load on first use of a function.
"""

from __future__ import annotations

import importlib
from typing import Any

from gyre.model.config import ModelConfig

_LAZY = {
    "build_model": "gyre.model.build",
    "ensure_model_parallel": "gyre.model.megatron",
    "model_config_of": "gyre.model.build",
    "TreeLayout": "gyre.model.attention",
    "DenseMask": "gyre.model.attention",
    "GyreCoreAttention": "gyre.model.megatron",
    "tree_logits": "gyre.model.forward",
    "tree_logprobs": "gyre.model.forward",
    "causal_logits": "gyre.model.forward",
    "predecessor_index": "gyre.model.forward",
    "hidden_states": "gyre.model.forward",
    "logits_from_hidden": "gyre.model.forward",
    "logprobs_of": "gyre.model.forward",
    "KVCache": "gyre.model.kv_cache",
    "prefill": "gyre.model.kv_cache",
    "decode_step": "gyre.model.kv_cache",
    "greedy_generate": "gyre.model.kv_cache",
    "init_model_parallel": "gyre.model.parallel",
    "load_full_weights": "gyre.model.tp_shard",
    "save_weights": "gyre.model.weights",
    "load_weights": "gyre.model.weights",
    "sha256_file": "gyre.model.weights",
}

__all__ = ["ModelConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gyre.model' has no attribute {name!r}")
