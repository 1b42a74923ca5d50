"""Tensor and context parallelism of the shared model: Megatron's parallel state over a real
process group, and the context-parallel attention exchange.

    init_model_parallel(tp, cp)   Megatron's parallel_state over the default process group (which the
                                  caller initialised: world = TP x CP x DP, gloo or NCCL)
    ModelParallel                 the layout a model was built under (build_model records it)
    cp_token_range(T, cp, rank)   the contiguous slice of a micro-batch's T packed tokens one CP rank holds
    gather_sequence(x, ...)       all-gather along the sequence; backward reduce-scatters (sums) the grads
    reduce_context_parallel_grads the CP ranks' partial parameter gradients summed (what DDP's DP x CP
                                  all-reduce does under Megatron)

**Tensor parallelism** is Megatron's own: with tensor_model_parallel_size = TP the GPTModel is built
from ColumnParallelLinear (fused q/k/v, MLP fc1, output layer), RowParallelLinear (attention
output, MLP fc2) and VocabParallelEmbedding, each rank holding 1/TP of the heads, of the MLP width and
of the vocabulary; `gyre.model.forward` drives those modules unchanged (the attention sees the heads
of its partition). The loss stays vocabulary-parallel (services/trainer/vocab_parallel.py).

**Context parallelism: all-gather of K and V, not a ring.** Every CP rank holds a contiguous slice of
the micro-batch's packed tokens (embedding, norms, MLP and the loss over its slice only). In each
layer its keys and values (after RoPE, from each token's own position id) are all-gathered over the
CP group, and its queries attend to all keys with its rows of the tree mask; backward reduce-scatters
the key/value gradients, so each rank gets the sum of every rank's gradient for its own keys. Why
not a ring: tree masks are not causal in the sequence index (a branch does not see its sibling
before it), so a ring's rule "skip blocks above the diagonal" does not apply and each step would
need its own mask block anyway; the all-gather sends the same bytes as a full ring in one
collective and keeps our attention kernels as they are. Memory cost per rank and layer: the full
sequence's K and V (2 x T x kv_heads/TP x head_dim values) instead of T/CP, plus the mask of its
rows (`gyre.model.attention.TreeRows`: T/CP x T booleans on CPU, a block mask on CUDA; built once per
micro-batch); activations of everything else are T/CP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gyre.errors import InvalidArgument


@dataclass(frozen=True)
class ModelParallel:
    """Tensor- and context-parallel sizes and this process's ranks in them (1 and 0: not parallel).

    Process groups are looked up in Megatron's parallel state when used, so a model (and a deep copy
    of it, such as the reference model) carries only these numbers."""

    tp_size: int = 1
    tp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0

    @property
    def tp_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    @property
    def cp_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()


NOT_PARALLEL = ModelParallel()


def current_model_parallel() -> ModelParallel:
    """The layout Megatron's parallel state holds now (NOT_PARALLEL before it is initialised)."""
    from gyre.model.megatron import quiet_megatron_import

    quiet_megatron_import()
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return NOT_PARALLEL
    return ModelParallel(
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        cp_size=parallel_state.get_context_parallel_world_size(),
        cp_rank=parallel_state.get_context_parallel_rank(),
    )


def init_model_parallel(tensor_parallel_size: int, context_parallel_size: int = 1) -> ModelParallel:
    """Initialise Megatron's parallel state with these sizes over the default process group.

    The caller has initialised torch.distributed (any rendezvous; gloo on CPU, NCCL on CUDA) with a
    world of TP x CP x DP ranks; Megatron orders them tp-cp-dp, so the TP ranks of one replica are
    consecutive. Idempotent for the same sizes; InvalidArgument when the state already holds other
    sizes or the world is not a multiple of TP x CP. The single-process path (rollout engines, a
    one-rank trainer) keeps using `ensure_model_parallel` (a world of one, TP = CP = 1)."""
    from gyre.model.megatron import _PARALLEL_INIT_LOCK, quiet_megatron_import

    quiet_megatron_import()
    from megatron.core import parallel_state

    if tensor_parallel_size < 1 or context_parallel_size < 1:
        raise InvalidArgument("tensor and context parallel sizes must be >= 1")
    if not dist.is_initialized():
        raise InvalidArgument(
            "init_model_parallel needs torch.distributed initialised (world = TP x CP x DP)"
        )
    world = dist.get_world_size()
    if world % (tensor_parallel_size * context_parallel_size):
        raise InvalidArgument(
            f"a world of {world} ranks is not a multiple of TP x CP = "
            f"{tensor_parallel_size} x {context_parallel_size}"
        )
    with _PARALLEL_INIT_LOCK:
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tensor_parallel_size,
                pipeline_model_parallel_size=1,
                context_parallel_size=context_parallel_size,
            )
    mp = current_model_parallel()
    if (mp.tp_size, mp.cp_size) != (tensor_parallel_size, context_parallel_size):
        raise InvalidArgument(
            f"Megatron's parallel state already holds TP={mp.tp_size}, CP={mp.cp_size}; "
            f"asked for TP={tensor_parallel_size}, CP={context_parallel_size}"
        )
    return mp


def cp_token_range(num_tokens: int, cp_size: int, cp_rank: int) -> tuple[int, int]:
    """[lo, hi) of the packed tokens CP rank `cp_rank` holds: contiguous slices of ceil(T / CP)
    tokens, the last ones shorter (possibly empty). Contiguous rather than load-balanced: with the
    all-gather exchange every rank's attention costs (its tokens) x T whatever the slice, so the
    zig-zag split a causal ring needs would not change the work."""
    per = -(-num_tokens // cp_size)
    lo = min(cp_rank * per, num_tokens)
    return lo, min(lo + per, num_tokens)


class _GatherAlong(torch.autograd.Function):
    """x (sequence or vocabulary at `dim`, this rank's `sizes[rank]` entries) -> every rank's slice
    concatenated in rank order.

    Forward: all-gather (slices padded to the largest so every rank sends the same shape, then
    trimmed). Backward with `sum_grads` (the ranks use the gathered tensor differently, as CP ranks
    use the keys): reduce-scatter, each rank gets the sum over ranks of its slice's gradient.
    Without (the ranks compute the same thing from it, as TP ranks do with gathered logits): each
    rank keeps its own slice of the gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, dim: int, sizes: list[int], rank: int, group: Any, sum_grads: bool
    ) -> torch.Tensor:
        per = max(sizes)
        xs = x.movedim(dim, 0)
        padded = xs.new_zeros((per, *xs.shape[1:]))
        padded[: xs.shape[0]] = xs
        out = xs.new_empty((per * len(sizes), *xs.shape[1:]))
        dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
        pieces = [out[r * per : r * per + n] for r, n in enumerate(sizes)]
        ctx.dim, ctx.sizes, ctx.rank, ctx.group, ctx.sum_grads = dim, sizes, rank, group, sum_grads
        return torch.cat(pieces).movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        sizes, per = ctx.sizes, max(ctx.sizes)
        gs = grad.movedim(ctx.dim, 0)
        start = sum(sizes[: ctx.rank])
        if not ctx.sum_grads:
            mine = gs[start : start + sizes[ctx.rank]]
        else:
            padded = gs.new_zeros((per * len(sizes), *gs.shape[1:]))
            offset = 0
            for r, n in enumerate(sizes):
                padded[r * per : r * per + n] = gs[offset : offset + n]
                offset += n
            scattered = gs.new_empty((per, *gs.shape[1:]))
            dist.reduce_scatter_tensor(scattered, padded, group=ctx.group)
            mine = scattered[: sizes[ctx.rank]]
        return mine.movedim(0, ctx.dim).contiguous(), None, None, None, None, None


def gather_sequence(x: torch.Tensor, dim: int, num_tokens: int, mp: ModelParallel) -> torch.Tensor:
    """The whole sequence of `num_tokens` from every CP rank's slice of it (`cp_token_range`),
    differentiable: backward sums the ranks' gradients of each slice (module docstring); `x` itself
    when CP = 1. Megatron's own sequence gather allocates its buffer on CUDA, hence this one."""
    if mp.cp_size == 1:
        return x
    sizes = [b - a for a, b in (cp_token_range(num_tokens, mp.cp_size, r) for r in range(mp.cp_size))]
    if x.shape[dim] != sizes[mp.cp_rank]:
        raise InvalidArgument(
            f"CP rank {mp.cp_rank} holds {x.shape[dim]} tokens, expected {sizes[mp.cp_rank]}"
        )
    out: torch.Tensor = _GatherAlong.apply(x, dim, sizes, mp.cp_rank, mp.cp_group, True)
    return out


def gather_vocab(logits: torch.Tensor, mp: ModelParallel) -> torch.Tensor:
    """Full-vocabulary logits [..., V] from this TP rank's vocabulary shard [..., V / TP]
    (backward keeps this rank's slice of the gradient, as Megatron's
    gather_from_tensor_model_parallel_region does; that one allocates on CUDA). Scoring paths only:
    the trainer's loss never gathers the vocabulary (services/trainer/vocab_parallel.py)."""
    if mp.tp_size == 1:
        return logits
    sizes = [logits.shape[-1]] * mp.tp_size
    out: torch.Tensor = _GatherAlong.apply(logits, logits.dim() - 1, sizes, mp.tp_rank, mp.tp_group, False)
    return out


def reduce_context_parallel_grads(model: Any, mp: ModelParallel) -> None:
    """Sum every parameter's gradient over the CP group (each CP rank backpropagated the loss of its
    own tokens): after it every CP rank holds the micro-batch's whole gradient. One flat all-reduce
    per dtype. A no-op for CP = 1."""
    if mp.cp_size == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=mp.cp_group)
        start = 0
        for g in same:
            g.copy_(flat[start : start + g.numel()].view_as(g))
            start += g.numel()
