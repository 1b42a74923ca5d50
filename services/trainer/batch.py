"""`PackedBatch`: the trainer's view of a tree-packed batch (one or more BatchChunk messages).

A tree arrives in one or more chunks (proto BatchChunk: node parents are tree node indices, a chunk
with first_node 0 starts a tree); `from_chunks` concatenates them into one sequence (offsets and
parents shifted), validating every array. `micro_batches` cuts a batch
into micro-batches of whole trees, splitting a tree larger than the budget into parts with recomputed
context (services/trainer/split_trees.py); `split` cuts a micro-batch into data-parallel shards at
tree boundaries, balancing tokens. The loss is a *sum* over tokens, so
shard losses (and gradients) add up to the batch's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gyre.errors import InvalidArgument
from gyre.v1 import trajectory_pb2
from services.trainer.split_trees import TreePart, split_tree

_PER_TOKEN = (
    "token_ids",
    "position_ids",
    "loss_mask",
    "weight_pos",
    "weight_neg",
    "kl_weight",
    "behaviour_logprobs",
    "policy_versions",
)


@dataclass
class PackedBatch:
    """Per-token tensors [T] plus ancestry arrays (see proto BatchChunk)."""

    batch_id: str
    token_ids: torch.Tensor
    position_ids: torch.Tensor
    node_offsets: list[int]
    node_lengths: list[int]
    node_parents: list[int]
    loss_mask: torch.Tensor
    weight_pos: torch.Tensor
    weight_neg: torch.Tensor
    kl_weight: torch.Tensor
    behaviour_logprobs: torch.Tensor
    policy_versions: torch.Tensor
    num_paths: int = 0
    num_flat_tokens: int = 0
    reward_sum: float = 0.0
    group_ids: list[str] = field(default_factory=list)
    # The trajectory service's normaliser of the weights (BatchChunk.normaliser); 0 = not recorded.
    normaliser: float = 0.0

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def to(self, device: torch.device | str, dtype: torch.dtype) -> PackedBatch:
        """Float arrays in `dtype`, everything on `device` (a new batch of the dataclass fields only:
        attributes a caller hung on this one, like the trainer bench's `path_weights`, stay behind)."""
        out: dict[str, Any] = {}
        for name in _PER_TOKEN:
            t = getattr(self, name)
            out[name] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        return dataclasses.replace(self, **out)

    def scaled(self, factor: float) -> PackedBatch:
        """The same batch with weight_pos, weight_neg and kl_weight multiplied by `factor` (in their
        dtype: convert first with `to` for precision). The loss is linear in these weights, so its
        value and gradient scale by `factor` too."""
        return dataclasses.replace(
            self, **{name: getattr(self, name) * factor for name in ("weight_pos", "weight_neg", "kl_weight")}
        )

    def tree_ranges(self) -> list[tuple[int, int]]:
        """(first node, end node) of each tree: a root and the nodes after it up to the next root."""
        roots = [i for i, p in enumerate(self.node_parents) if p < 0]
        return list(zip(roots, roots[1:] + [len(self.node_parents)], strict=True))

    def select_trees(self, ranges: Sequence[tuple[int, int]]) -> PackedBatch:
        """A batch of the given trees only (node indices renumbered)."""
        token_idx: list[torch.Tensor] = []
        offsets: list[int] = []
        lengths: list[int] = []
        parents: list[int] = []
        for a, b in ranges:
            shift_nodes = len(offsets) - a
            for i in range(a, b):
                offsets.append(sum(lengths))
                lengths.append(self.node_lengths[i])
                p = self.node_parents[i]
                parents.append(p + shift_nodes if p >= 0 else -1)
                token_idx.append(
                    torch.arange(self.node_offsets[i], self.node_offsets[i] + self.node_lengths[i])
                )
        idx = torch.cat(token_idx) if token_idx else torch.zeros(0, dtype=torch.long)
        fields = {name: getattr(self, name)[idx] for name in _PER_TOKEN}
        return PackedBatch(
            self.batch_id, node_offsets=offsets, node_lengths=lengths, node_parents=parents, **fields
        )

    def select_parts(self, parts: Sequence[TreePart]) -> PackedBatch:
        """A batch of the given tree parts (services/trainer/split_trees.py), node indices renumbered.

        A part's context nodes (ancestors it does not train) keep their tokens and positions but carry
        no loss: loss_mask False, weights and behaviour log-probs 0, policy version -1."""
        token_idx: list[torch.Tensor] = []
        trained_idx: list[torch.Tensor] = []
        offsets: list[int] = []
        lengths: list[int] = []
        parents: list[int] = []
        for part in parts:
            new_index = {old: len(offsets) + k for k, old in enumerate(part.nodes)}
            for i in part.nodes:
                offsets.append(sum(lengths))
                lengths.append(self.node_lengths[i])
                p = self.node_parents[i]
                parents.append(new_index[p] if p >= 0 else -1)
                tokens = torch.arange(self.node_offsets[i], self.node_offsets[i] + self.node_lengths[i])
                token_idx.append(tokens)
                trained_idx.append(torch.full_like(tokens, 1 if part.is_trained(i) else 0, dtype=torch.bool))
        empty = torch.zeros(0, dtype=torch.long)
        idx = torch.cat(token_idx) if token_idx else empty
        trained = torch.cat(trained_idx) if trained_idx else empty.bool()
        fields = {name: getattr(self, name)[idx] for name in _PER_TOKEN}
        if not bool(trained.all()):
            for name in ("weight_pos", "weight_neg", "kl_weight", "behaviour_logprobs"):
                fields[name] = torch.where(trained, fields[name], torch.zeros_like(fields[name]))
            fields["loss_mask"] = fields["loss_mask"] & trained
            fields["policy_versions"] = torch.where(trained, fields["policy_versions"], -1)
        return PackedBatch(
            self.batch_id, node_offsets=offsets, node_lengths=lengths, node_parents=parents, **fields
        )

    def micro_batches(self, max_tokens: int) -> list[PackedBatch]:
        """Consecutive runs of trees of at most `max_tokens` tokens each; at least one micro-batch.

        A tree larger than `max_tokens` is split along its nodes into parts that carry their
        ancestors as recomputed, untrained context (`split_trees.split_tree`: parts of at most
        max(max_tokens, the tree's longest path) tokens, unless that recomputes more than the tree's
        own tokens, when it stays whole); whole trees and parts are packed in order.
        The loss is a sum over tokens and every token is trained in exactly one micro-batch, so the
        micro-batches' losses and gradients add up to the batch's."""
        groups: list[list[TreePart]] = [[]]
        used = 0
        for a, b in self.tree_ranges():
            for part in split_tree(self.node_lengths, self.node_parents, a, b, max_tokens):
                if groups[-1] and used + part.num_tokens > max_tokens:
                    groups.append([])
                    used = 0
                groups[-1].append(part)
                used += part.num_tokens
        return [self.select_parts(g) for g in groups]

    def split(self, num_shards: int) -> list[PackedBatch]:
        """`num_shards` batches of whole trees with balanced token counts (some may be empty)."""
        trees = self.tree_ranges()
        sizes = [sum(self.node_lengths[a:b]) for a, b in trees]
        shards: list[list[tuple[int, int]]] = [[] for _ in range(num_shards)]
        load = [0] * num_shards
        for t in sorted(range(len(trees)), key=lambda i: -sizes[i]):
            s = load.index(min(load))
            shards[s].append(trees[t])
            load[s] += sizes[t]
        return [self.select_trees(sorted(s)) for s in shards]


_DTYPES = {
    "token_ids": torch.long,
    "position_ids": torch.long,
    "loss_mask": torch.bool,
    "weight_pos": torch.float32,
    "weight_neg": torch.float32,
    "kl_weight": torch.float32,
    "behaviour_logprobs": torch.float32,
    "policy_versions": torch.long,
}


def from_chunks(chunks: Sequence[trajectory_pb2.BatchChunk]) -> PackedBatch:
    """Concatenate the chunks of one batch; InvalidArgument on ragged, out-of-order or non-finite arrays.

    A chunk with ``first_node`` 0 starts a tree; one with ``first_node`` > 0 continues the previous
    chunk's tree (its ``node_parents`` are tree node indices), so a tree streamed in pieces is
    rebuilt as one."""
    if not chunks:
        raise InvalidArgument("a batch needs at least one chunk")
    batch_id = chunks[0].batch_id
    cols: dict[str, list[torch.Tensor]] = {name: [] for name in _PER_TOKEN}
    offsets: list[int] = []
    lengths: list[int] = []
    parents: list[int] = []
    num_paths = num_flat = num_tokens = 0
    reward = 0.0
    groups: list[str] = []
    normaliser = chunks[0].normaliser
    tree_base = 0  # batch node index of the current tree's root
    continues = False
    for c in chunks:
        where = f"batch {batch_id} chunk {c.chunk_index}"
        if c.batch_id != batch_id:
            raise InvalidArgument(f"chunk of batch {c.batch_id!r} inside batch {batch_id!r}")
        if c.normaliser != normaliser or not (math.isfinite(normaliser) and normaliser >= 0):
            raise InvalidArgument(
                f"{where}: normaliser {c.normaliser} (chunk 0 has {normaliser}; "
                "it must be one finite value >= 0 per batch)"
            )
        if c.first_node == 0:
            if continues:
                raise InvalidArgument(f"{where}: starts a tree while the previous tree continues")
            tree_base = len(offsets)
        elif not continues or c.first_node != len(offsets) - tree_base:
            raise InvalidArgument(
                f"{where}: continues a tree at node {c.first_node}, but the tree so far has "
                f"{len(offsets) - tree_base} nodes"
            )
        continues = c.tree_continues
        n = len(c.token_ids)
        for name in _PER_TOKEN:
            arr = getattr(c, name)
            if len(arr) != n:
                raise InvalidArgument(f"{where}: {name} has {len(arr)} values for {n} tokens")
            t = torch.tensor(list(arr), dtype=_DTYPES[name])
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise InvalidArgument(f"{where}: {name} holds NaN or infinity")
            cols[name].append(t)
        if not len(c.node_offsets) == len(c.node_lengths) == len(c.node_parents):
            raise InvalidArgument(f"{where}: node arrays differ in length")
        offsets.extend(o + num_tokens for o in c.node_offsets)
        lengths.extend(c.node_lengths)
        parents.extend(p + tree_base if p >= 0 else -1 for p in c.node_parents)
        num_tokens += n
        num_paths += c.num_paths
        num_flat += c.num_flat_tokens
        reward += c.reward_sum
        groups.extend(c.group_ids)
    if continues:
        raise InvalidArgument(f"batch {batch_id}: its last tree continues past the last chunk")
    fields = {name: torch.cat(cols[name]) for name in _PER_TOKEN}
    return PackedBatch(
        batch_id,
        node_offsets=offsets,
        node_lengths=lengths,
        node_parents=parents,
        num_paths=num_paths,
        num_flat_tokens=num_flat,
        reward_sum=reward,
        group_ids=groups,
        normaliser=normaliser,
        **fields,
    )


def to_chunk(batch: PackedBatch, chunk_index: int = 0, last: bool = True) -> trajectory_pb2.BatchChunk:
    """The BatchChunk message of a batch (tests and benchmarks produce batches with it)."""
    return trajectory_pb2.BatchChunk(
        batch_id=batch.batch_id,
        chunk_index=chunk_index,
        last=last,
        token_ids=batch.token_ids.tolist(),
        position_ids=batch.position_ids.tolist(),
        node_offsets=batch.node_offsets,
        node_lengths=batch.node_lengths,
        node_parents=batch.node_parents,
        loss_mask=batch.loss_mask.int().tolist(),
        weight_pos=batch.weight_pos.tolist(),
        weight_neg=batch.weight_neg.tolist(),
        kl_weight=batch.kl_weight.tolist(),
        behaviour_logprobs=batch.behaviour_logprobs.tolist(),
        policy_versions=batch.policy_versions.tolist(),
        num_paths=batch.num_paths,
        num_flat_tokens=batch.num_flat_tokens,
        reward_sum=batch.reward_sum,
        group_ids=batch.group_ids,
        normaliser=batch.normaliser,
    )
