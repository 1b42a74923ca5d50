"""Forward passes that give every token its own position id: tree-packed, batched causal, cached.

The model is Megatron's `GPTModel`; this module drives its pieces in order — embedding ->
for each layer: norm, fused q/k/v (Megatron's own split), RoPE from *our* position ids, our core
attention with our mask, output projection, residual, norm, MLP, residual -> final norm -> output
layer. Megatron's `GPTModel.forward` is not used: it derives RoPE from the sequence index, which
is wrong for tree-packed tokens (a branch's tokens keep the positions of their original sequence).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from gyre.errors import InvalidArgument
from gyre.model.attention import AttentionMask, TreeLayout
from gyre.model.build import model_config_of
from gyre.model.config import ModelConfig

# (layer index, k [B, Hkv, S, d], v) -> (k, v) that the new queries attend to (e.g. cache + new).
KVHook = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] (float64), with `cfg.rope_scaling` applied.

    'llama3' is Llama 3.1's scaling (HF `_compute_llama3_parameters`): wavelengths shorter than
    original_max / high_freq_factor are kept, longer than original_max / low_freq_factor divided
    by the factor, and the band between interpolated linearly in original_max / wavelength.
    """
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
    if cfg.rope_scaling == "llama3":
        factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        original = cfg.rope_original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(
    model: Any, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, S, d] for position ids [B, S] (rotate-half convention, as Megatron and HF Llama)."""
    inv_freq = rope_inv_freq(model_config_of(model), position_ids.device)
    angles = position_ids.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _add_bias(out_bias: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    out, bias = out_bias
    return out if bias is None else out + bias


def _layer(
    layer: Any,
    i: int,
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    mask: AttentionMask,
    kv_hook: KVHook | None,
) -> torch.Tensor:
    attn = layer.self_attention
    q, k, v = attn.get_query_key_value_tensors(layer.input_layernorm(x))  # [S, B, heads, d]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, heads, S, d]
    if cos is not None and sin is not None:
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    if kv_hook is not None:
        k, v = kv_hook(i, k, v)
    ctx = attn.core_attention(
        q.permute(2, 0, 1, 3), k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3), mask, attn_mask_type=None
    )
    x = x + _add_bias(attn.linear_proj(ctx))
    return x + _add_bias(layer.mlp(layer.pre_mlp_layernorm(x)))


def hidden_states(
    model: Any,
    token_ids: torch.Tensor,
    position_ids: torch.Tensor,
    mask: AttentionMask,
    kv_hook: KVHook | None = None,
) -> torch.Tensor:
    """Final-norm hidden states [B, S, hidden] for token/position ids [B, S]."""
    cfg = model_config_of(model)
    if token_ids.shape != position_ids.shape:
        raise InvalidArgument(
            f"token_ids {tuple(token_ids.shape)} and position_ids {tuple(position_ids.shape)} differ"
        )
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= cfg.vocab_size):
        raise InvalidArgument(f"token ids must lie in [0, {cfg.vocab_size})")
    if position_ids.numel() and (
        int(position_ids.min()) < 0 or int(position_ids.max()) >= cfg.max_position_embeddings
    ):
        raise InvalidArgument(f"position ids must lie in [0, {cfg.max_position_embeddings})")
    x = model.embedding(input_ids=token_ids, position_ids=position_ids)  # [S, B, hidden]
    cos = sin = None
    if cfg.position_embedding == "rope":
        cos, sin = rope_cos_sin(model, position_ids, x.dtype)
    # activation recompute (the trainer's `recompute_granularity: full` sets gyre_recompute): only each
    # layer's input is kept for backward, the layer is run again there
    recompute = getattr(model, "gyre_recompute", False) and torch.is_grad_enabled()
    for i, layer in enumerate(model.decoder.layers):
        if recompute:
            x = checkpoint(_layer, layer, i, x, cos, sin, mask, kv_hook, use_reentrant=False)
        else:
            x = _layer(layer, i, x, cos, sin, mask, kv_hook)
    x = model.decoder.final_layernorm(x)
    return x.transpose(0, 1)


def logits_from_hidden(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Output layer: hidden [..., hidden] -> logits [..., vocab] (under tensor parallelism the
    vocabulary shards are all-gathered, so every rank gets the full logits)."""
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    out, _ = model.output_layer(hidden, weight=weight)
    parallel = getattr(model, "gyre_parallel", None)
    if parallel is not None and parallel.tp_size > 1:
        from gyre.model.parallel import gather_vocab

        out = gather_vocab(out, parallel)
    return out


def causal_logits(
    model: Any,
    token_ids: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    lengths: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched causal forward: ids [B, S] (right-padded to `lengths`) -> logits [B, S, V].

    position_ids default to 0..S-1. Logits at padded positions are meaningless.
    """
    b, s = token_ids.shape
    if position_ids is None:
        position_ids = torch.arange(s, device=token_ids.device).expand(b, s)
    mask: AttentionMask = None
    if lengths is not None:
        from gyre.model.attention import DenseMask

        lens = torch.as_tensor(lengths, device=token_ids.device)
        idx = torch.arange(s, device=token_ids.device)
        allowed = (idx[None, None, :] <= idx[None, :, None]) & (idx[None, None, :] < lens[:, None, None])
        allowed |= torch.eye(s, dtype=torch.bool, device=token_ids.device)[None]  # padded rows see themselves
        mask = DenseMask(allowed[:, None])
    return logits_from_hidden(model, hidden_states(model, token_ids, position_ids, mask))


def _layout(num_tokens: int, node_offsets: Any, node_lengths: Any, node_parents: Any) -> TreeLayout:
    as_list = lambda a: a.tolist() if hasattr(a, "tolist") else list(a)  # noqa: E731
    return TreeLayout(num_tokens, as_list(node_offsets), as_list(node_lengths), as_list(node_parents))


def tree_logits(
    model: Any,
    token_ids: torch.Tensor,
    position_ids: torch.Tensor,
    node_offsets: Any,
    node_lengths: Any,
    node_parents: Any,
) -> torch.Tensor:
    """Tree-packed forward: ids/positions [T] + ancestry arrays (proto BatchChunk) -> logits [T, V].

    Token a attends to b iff b's node is an ancestor-or-self of a's node and b <= a; every token
    keeps its original position id. Equal to running each root-to-leaf path on its own.
    """
    layout = _layout(token_ids.shape[0], node_offsets, node_lengths, node_parents)
    hidden = hidden_states(model, token_ids[None], position_ids[None], layout)
    return logits_from_hidden(model, hidden[0])


def predecessor_index(layout: TreeLayout) -> torch.Tensor:
    """[T] long: the token whose logits predict token t (previous token on t's path), -1 for none."""
    pred = torch.full((layout.num_tokens,), -1, dtype=torch.long)
    last_token = [-1] * layout.num_nodes  # last token of each node's chain (skipping empty nodes)
    for i in range(layout.num_nodes):
        p = layout.node_parents[i]
        before = last_token[p] if p >= 0 else -1
        off, n = layout.node_offsets[i], layout.node_lengths[i]
        if n:
            pred[off] = before
            pred[off + 1 : off + n] = torch.arange(off, off + n - 1)
            last_token[i] = off + n - 1
        else:
            last_token[i] = before
    return pred


def tree_logprobs(
    model: Any,
    token_ids: torch.Tensor,
    position_ids: torch.Tensor,
    node_offsets: Any,
    node_lengths: Any,
    node_parents: Any,
) -> torch.Tensor:
    """[T] log p(token_t | its ancestors) under the model; 0 for a root's first token (no context)."""
    layout = _layout(token_ids.shape[0], node_offsets, node_lengths, node_parents)
    hidden = hidden_states(model, token_ids[None], position_ids[None], layout)[0]
    return logprobs_of(model, hidden, token_ids, predecessor_index(layout).to(token_ids.device))


def logprobs_of(
    model: Any, hidden: torch.Tensor, token_ids: torch.Tensor, pred: torch.Tensor
) -> torch.Tensor:
    """Log-prob of token t from the hidden state of token pred[t] (0 where pred is -1)."""
    has = pred >= 0
    logits = logits_from_hidden(model, hidden[pred.clamp(min=0)])
    lp = torch.log_softmax(
        logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, dim=-1
    )
    picked = lp.gather(-1, token_ids[:, None].long())[:, 0]
    return torch.where(has, picked, torch.zeros_like(picked))
