"""Attention over arbitrary (tree) masks, exact on CPU and CUDA (pure torch; the Megatron module is gyre.model.megatron).

Masks (True = the query may attend to the key):

- `TreeLayout` — a tree-packed batch (see proto BatchChunk): token a attends to token b iff b's
  node is an ancestor-or-self of a's node and b <= a. Tokens are laid out node by node in
  depth-first order, so every visible key precedes its query. Three exact kernels:
    * ``dense``: one `scaled_dot_product_attention` call with a boolean [T, T] mask; O(T^2) work.
    * ``nodes``: each node's queries over the keys of its ancestor chain plus itself, batched into
      one SDPA call per group of nodes with the same chain shape (a root alone: causal); the work is
      sum over tokens of (visible keys), i.e. never more than training the paths separately.
    * ``flex``: `torch.nn.attention.flex_attention` with a block mask built from the node ancestry
      (compiled; the fast path on CUDA, skipping fully masked blocks). The mask is built once per
      layout (`TreeLayout.flex_block_mask`), i.e. once per micro-batch, and shared by every layer.
- `DenseMask` — any boolean mask [B or 1, 1, Sq, Sk] (padding + causal, KV-cache decode).
- ``None`` — plain causal attention (Sq == Sk).

Tensors here are [batch, heads, seq, head_dim]; key/value may have fewer heads than the query
(grouped-query attention), query head h uses key/value head h // (heads / kv_heads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from gyre.errors import InvalidArgument


@dataclass(frozen=True)
class _NodeGroup:
    """Nodes whose chains (non-empty nodes, root first) have the same token counts `shape`.

    `nodes[g]` is the g-th node of the group; `levels[d][g]` the node at depth d of its chain."""

    shape: tuple[int, ...]
    nodes: list[int]
    levels: list[list[int]]


@dataclass
class TreeLayout:
    """Ancestry of a tree-packed sequence; validates the arrays at construction (InvalidArgument).

    `node_offsets[i]`, `node_lengths[i]`: the tokens of node i; nodes must tile [0, num_tokens) in
    order. `node_parents[i]`: parent node index (< i) or -1 for a root.
    """

    num_tokens: int
    node_offsets: list[int]
    node_lengths: list[int]
    node_parents: list[int]
    _chains: list[list[int]] = field(default_factory=list, repr=False)
    _masks: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict, repr=False)
    _node_groups: list[_NodeGroup] | None = field(default=None, repr=False)
    _block_masks: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.node_offsets = [int(x) for x in self.node_offsets]
        self.node_lengths = [int(x) for x in self.node_lengths]
        self.node_parents = [int(x) for x in self.node_parents]
        n = len(self.node_offsets)
        if len(self.node_lengths) != n or len(self.node_parents) != n:
            raise InvalidArgument(
                f"node arrays differ in length: offsets {n}, lengths {len(self.node_lengths)}, "
                f"parents {len(self.node_parents)}"
            )
        expected = 0
        for i in range(n):
            if self.node_offsets[i] != expected or self.node_lengths[i] < 0:
                raise InvalidArgument(
                    f"node {i} occupies [{self.node_offsets[i]}, +{self.node_lengths[i]}) but nodes must tile "
                    f"the tokens in order (expected offset {expected}, length >= 0)"
                )
            expected += self.node_lengths[i]
            if not -1 <= self.node_parents[i] < i:
                raise InvalidArgument(
                    f"node {i} has parent {self.node_parents[i]}: a parent must precede its child (or be -1)"
                )
        if expected != self.num_tokens:
            raise InvalidArgument(f"nodes cover {expected} tokens but the sequence has {self.num_tokens}")
        self._chains = []
        for i in range(n):
            p = self.node_parents[i]
            self._chains.append((self._chains[p] if p >= 0 else []) + [i])

    @classmethod
    def chain(cls, num_tokens: int) -> TreeLayout:
        """One node holding every token: plain causal attention."""
        return cls(num_tokens, [0], [num_tokens], [-1])

    @property
    def num_nodes(self) -> int:
        return len(self.node_offsets)

    def ancestors(self, node: int) -> list[int]:
        """Node indices from the root down to `node` (inclusive)."""
        return self._chains[node]

    def node_of_token(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[T] long: the node each token belongs to."""
        lengths = torch.tensor(self.node_lengths, dtype=torch.long)
        return torch.repeat_interleave(torch.arange(self.num_nodes), lengths).to(device)

    def ancestor_matrix(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[N, N] bool: [i, j] is True iff node j is an ancestor-or-self of node i."""
        m = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.bool)
        for i, chain in enumerate(self._chains):
            m[i, chain] = True
        return m.to(device)

    def dense_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[T, T] bool mask, True where query a may attend to key b."""
        node = self.node_of_token(device)
        anc = self.ancestor_matrix(device)
        idx = torch.arange(self.num_tokens, device=device)
        return anc[node[:, None], node[None, :]] & (idx[None, :] <= idx[:, None])

    def dense_mask_rows(self, start: int, stop: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[stop - start, T] bool: the dense mask's rows of queries [start, stop) (a context-parallel
        rank's queries against every key), built once per layout and device and cached, so the
        policy's and the reference model's forward of one micro-batch share it."""
        key = f"rows:{start}:{stop}:{device}"
        if key not in self._block_masks:
            node = self.node_of_token(device)
            anc = self.ancestor_matrix(device)
            idx = torch.arange(self.num_tokens, device=device)
            rows = idx[start:stop]
            self._block_masks[key] = anc[node[rows][:, None], node[None, :]] & (idx[None, :] <= rows[:, None])
        mask: torch.Tensor = self._block_masks[key]
        return mask

    def flex_row_block_mask(self, start: int, stop: int, device: torch.device) -> Any:
        """The flex-attention `BlockMask` of queries [start, stop) against all keys, cached per layout
        (`flex_block_mask` for a slice of the queries)."""
        key = f"flexrows:{start}:{stop}:{device}"
        if key not in self._block_masks:
            from torch.nn.attention import flex_attention as flex

            node = self.node_of_token(device)
            anc = self.ancestor_matrix(device)

            def mask_mod(b: Any, h: Any, qi: Any, ki: Any) -> Any:
                return anc[node[qi + start], node[ki]] & (ki <= qi + start)

            self._block_masks[key] = flex.create_block_mask(
                mask_mod, None, None, stop - start, self.num_tokens, device=device
            )
        return self._block_masks[key]

    def node_groups(self) -> list[_NodeGroup]:
        """The non-empty nodes grouped by the token counts along their chains (empty nodes skipped),
        computed once per layout: the nodes of a group have the same query count and key layout, so
        one batched attention call serves them all (`_node_blocked_attention`)."""
        if self._node_groups is None:
            by_shape: dict[tuple[int, ...], list[list[int]]] = {}
            for i in range(self.num_nodes):
                if self.node_lengths[i]:
                    chain = [j for j in self._chains[i] if self.node_lengths[j]]
                    by_shape.setdefault(tuple(self.node_lengths[j] for j in chain), []).append(chain)
            self._node_groups = [
                _NodeGroup(
                    shape, [c[-1] for c in chains], [[c[d] for c in chains] for d in range(len(shape))]
                )
                for shape, chains in by_shape.items()
            ]
        return self._node_groups

    def suffix_causal_mask(
        self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype
    ) -> torch.Tensor:
        """[1, 1, n, K] additive mask (0 or -inf) of a node whose chain has token counts `shape`
        (n = shape[-1], K = sum(shape)): every ancestor key, causal on its own keys."""
        key = (shape, str(device), dtype)
        if key not in self._masks:
            n, k = shape[-1], sum(shape)
            allowed = torch.arange(k, device=device)[None, :] <= (
                k - n + torch.arange(n, device=device)[:, None]
            )
            mask = torch.zeros(n, k, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))
            self._masks[key] = mask[None, None]
        return self._masks[key]

    def flex_block_mask(self, device: torch.device) -> Any:
        """The flex-attention `BlockMask` of this layout on `device`, built on the first call and
        cached: a micro-batch builds one layout and every layer's attention reuses its mask (building
        it walks the whole T x T block grid, so building it per layer call cost num_layers times)."""
        key = str(device)
        if key not in self._block_masks:
            from torch.nn.attention import flex_attention as flex

            node = self.node_of_token(device)
            anc = self.ancestor_matrix(device)

            def mask_mod(b: Any, h: Any, qi: Any, ki: Any) -> Any:
                return anc[node[qi], node[ki]] & (ki <= qi)

            t = self.num_tokens
            self._block_masks[key] = flex.create_block_mask(mask_mod, None, None, t, t, device=device)
        return self._block_masks[key]

    def visible_keys(self, node: int) -> torch.Tensor:
        """[K] long: token indices node `node` may see (ancestors' tokens, then its own), ascending."""
        parts = [
            torch.arange(self.node_offsets[j], self.node_offsets[j] + self.node_lengths[j])
            for j in self._chains[node]
        ]
        return torch.cat(parts)

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node chains (a leaf = a node that is nobody's parent)."""
        has_child = set(p for p in self.node_parents if p >= 0)
        return [self._chains[i] for i in range(self.num_nodes) if i not in has_child]

    def path_tokens(self) -> list[torch.Tensor]:
        """Token indices of every root-to-leaf path, in order."""
        return [self.visible_keys(chain[-1]) for chain in self.paths()]


@dataclass
class DenseMask:
    """An explicit boolean mask [B or 1, 1, Sq, Sk]; True = may attend."""

    mask: torch.Tensor


@dataclass
class TreeRows:
    """Queries [start, stop) of a tree-packed sequence against all of its keys: a context-parallel
    rank's slice (gyre.model.parallel). Kernels: the dense mask's rows (`TreeLayout.dense_mask_rows`,
    SDPA; CPU and CUDA) or, with backend flex (the 'auto' choice on CUDA), flex attention with a
    block mask of those rows (`TreeLayout.flex_row_block_mask`), which skips fully masked blocks."""

    layout: TreeLayout
    start: int
    stop: int


AttentionMask = TreeLayout | DenseMask | TreeRows | None

_flex_compiled: Any = None


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


def choose_tree_backend(layout: TreeLayout, device: torch.device, requested: str) -> str:
    """The kernel 'auto' picks: flex on CUDA; on CPU per-node SDPA for large trees of few nodes."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "flex"
    if layout.num_nodes == 1:
        return "causal"
    if layout.num_tokens >= 512 and layout.num_tokens / layout.num_nodes >= 32:
        return "nodes"
    return "dense"


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TreeLayout, backend: str = "auto"
) -> torch.Tensor:
    """Exact attention of a tree-packed sequence; q/k/v [1, heads, T, d] -> [1, heads, T, d]."""
    if q.shape[2] != layout.num_tokens:
        raise InvalidArgument(f"sequence has {q.shape[2]} tokens but the tree layout {layout.num_tokens}")
    kind = choose_tree_backend(layout, q.device, backend)
    if kind == "causal":
        return _sdpa(q, k, v, None, True)
    if kind == "dense":
        return _sdpa(q, k, v, layout.dense_mask(q.device)[None, None], False)
    if kind == "nodes":
        return _node_blocked_attention(q, k, v, layout)
    if kind == "flex":
        return _flex_tree_attention(q, k, v, layout)
    raise InvalidArgument(f"unknown attention backend {backend!r}; use auto, dense, nodes or flex")


def _node_blocked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TreeLayout
) -> torch.Tensor:
    """Each node's queries over its ancestors' keys, one SDPA call per group of same-shaped nodes.

    Tensors are split into per-node pieces once; a group's keys are its chains' pieces stacked and
    concatenated (a piece shared by the whole group, such as a common prompt, is expanded, not
    copied per node first), so backward touches only visible keys and sums a shared piece's
    gradient in one reduction. A node without non-empty ancestors is plain causal attention on its
    own (one call each, as a flat trainer runs each sample). The call count per layer is the number
    of distinct chain shapes, not of nodes: for a wide tree of equal branches, a handful."""
    sizes = layout.node_lengths
    qs, ks, vs = (t.split(sizes, dim=2) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    outs: list[torch.Tensor] = list(qs)  # empty nodes keep their (empty) piece
    for group in layout.node_groups():
        if len(group.shape) == 1:
            for i in group.nodes:
                outs[i] = _sdpa(qs[i], ks[i], vs[i], None, True)
            continue
        g = len(group.nodes)

        def stacked(pieces: Sequence[torch.Tensor], level: list[int], g: int = g) -> torch.Tensor:
            if all(j == level[0] for j in level):
                return pieces[level[0]].expand(g, -1, -1, -1)
            return torch.cat([pieces[j] for j in level])

        keys = torch.cat([stacked(ks, level) for level in group.levels], dim=2)
        values = torch.cat([stacked(vs, level) for level in group.levels], dim=2)
        mask = layout.suffix_causal_mask(group.shape, q.device, q.dtype)
        out = F.scaled_dot_product_attention(
            stacked(qs, group.levels[-1]), keys, values, attn_mask=mask, enable_gqa=gqa
        )
        for i, piece in zip(group.nodes, out.split(1), strict=True):
            outs[i] = piece
    return torch.cat(outs, dim=2)


def _flex_tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TreeLayout, block_mask: Any = None
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    global _flex_compiled
    block_mask = layout.flex_block_mask(q.device) if block_mask is None else block_mask
    fn = flex_attention
    if q.device.type == "cuda":
        if _flex_compiled is None:
            _flex_compiled = torch.compile(flex_attention, dynamic=True)
        fn = _flex_compiled
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, backend: str = "auto"
) -> torch.Tensor:
    """Dispatch on the mask kind; q [B, H, Sq, d], k/v [B, Hkv, Sk, d] -> [B, H, Sq, d]."""
    if mask is None:
        return _sdpa(q, k, v, None, q.shape[2] > 1)
    if isinstance(mask, TreeLayout):
        return tree_attention(q, k, v, mask, backend)
    if isinstance(mask, TreeRows):
        return tree_rows_attention(q, k, v, mask, backend)
    return _sdpa(q, k, v, mask.mask, False)


def tree_rows_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: TreeRows, backend: str = "auto"
) -> torch.Tensor:
    """Queries [start, stop) of a tree-packed sequence over all T keys: q [1, H, stop - start, d],
    k/v [1, Hkv, T, d]. flex when asked or ('auto') on CUDA, else SDPA with the dense mask's rows."""
    layout = rows.layout
    if q.shape[2] != rows.stop - rows.start or k.shape[2] != layout.num_tokens:
        raise InvalidArgument(
            f"{q.shape[2]} queries and {k.shape[2]} keys for rows [{rows.start}, {rows.stop}) of "
            f"{layout.num_tokens} tokens"
        )
    if backend == "flex" or (backend == "auto" and q.device.type == "cuda"):
        block_mask = layout.flex_row_block_mask(rows.start, rows.stop, q.device)
        return _flex_tree_attention(q, k, v, layout, block_mask)
    return _sdpa(q, k, v, layout.dense_mask_rows(rows.start, rows.stop, q.device)[None, None], False)


def pad_stack(seqs: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """Right-pad [H, L_i, d] tensors with zeros to `length` and stack -> [B, H, length, d]."""
    out = seqs[0].new_zeros(len(seqs), seqs[0].shape[0], length, seqs[0].shape[-1])
    for i, s in enumerate(seqs):
        out[i, :, : s.shape[1]] = s
    return out
