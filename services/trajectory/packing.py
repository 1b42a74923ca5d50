"""Tree-packed batches: whole trees of scored groups under a token budget, as BatchChunk arrays.

Layout (the contract in proto/gyre/v1/trajectory.proto, BatchChunk): trees one after the other, each
in one or more chunks of at most ``max_chunk_bytes`` serialized bytes; the nodes of the selected
executions' paths are laid out node by node in depth-first pre-order (children by node id); a node
that crosses a chunk boundary continues as a child piece in the next chunk; ``node_parents`` are
tree node indices (pieces counted), ``position_ids`` are each token's position in its original
sequence (``node.start + i``). Packing builds one node's arrays and one chunk at a time.

Weights. For an executions' representative e (see dedup): ``norm_e = multiplicity_e *
dedup_weight_e / normaliser`` and ``w_{e,t} = advantage_{e,t} * norm_e``, where ``advantage_{e,t}``
is the advantage of the call of e that generated token t (``PackedExecution.call_advantages``;
with credit assignment "execution" the same for every call), averaged over the members e stands
for, and ``normaliser`` is the number of trained tokens of the batch counted per member (sum of
norm numerators times generated tokens), so the packed loss is a token mean over every member of
every group. A token t is *trained for e* when e generated it (``TaskTree.owned_positions``: each
generated token once, where it was generated). Then ``weight_pos_t`` / ``weight_neg_t`` sum
w_{e,t} over the executions that trained t with w_{e,t} >= 0 / < 0 and ``kl_weight_t`` sums norm_e,
so for any per-token losses l(+), l(-), kl:

    sum_t weight_pos_t l(+)_t + weight_neg_t l(-)_t + kl_weight_t kl_t
        = sum_e sum_{t trained for e} w_{e,t} l(sign w_{e,t})_t + norm_e kl_t

which is the loss of training every execution's paths separately (tests/trajectory/test_packing.py).
Behaviour log-prob and version of a token come from the first execution (by id) that generated it.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gyre.v1 import trajectory_pb2
from services.trajectory.tree import LOGPROB_DTYPE, Node, TaskTree


@dataclass(slots=True)
class PackedExecution:
    """One representative execution as the packer needs it."""

    execution_id: str
    advantage: float  # mean advantage of the members it stands for
    multiplicity: int
    dedup_weight: float
    reward_sum: float  # sum of the members' rewards
    num_partial: int  # members scored as partial
    # call_seq -> advantage of that call's generated tokens (mean over the members); a call not
    # listed gets ``advantage``. Empty = one advantage for the whole execution (credit "execution").
    call_advantages: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class ScoredGroup:
    group_id: str
    task_id: str
    executions: list[PackedExecution]


@dataclass(slots=True)
class TreeBatch:
    """A batch of packed trees as the trajectory service stores and sends it (BatchChunks for the
    wire); the trainer turns the chunks into tensors (services/trainer/batch.py `PackedBatch`)."""

    batch_id: str
    chunks: list[trajectory_pb2.BatchChunk]
    group_ids: list[str]
    num_tokens: int
    num_flat_tokens: int
    num_paths: int
    num_partial_paths: int
    min_policy_version: int
    max_policy_version: int
    normaliser: float
    paths: list[tuple[str, int]] = field(default_factory=list)  # (execution_id, leaf node id)
    num_chunks: int = 0
    num_trees: int = 0
    max_chunk_bytes: int = 0  # serialized bytes of the largest chunk


def _group_nodes(tree: TaskTree, group: ScoredGroup) -> set[int]:
    return tree.nodes_of(e.execution_id for e in group.executions)


def trainable_tokens(tree: TaskTree, group: ScoredGroup) -> int:
    """Tokens some execution of the group generated (0: nothing to train, e.g. no completions or no calls)."""
    return sum(
        int(mask.sum())
        for e in group.executions
        for mask, _, _ in tree.owned_positions(e.execution_id).values()
    )


def select_groups(
    trees: dict[str, TaskTree], groups: list[ScoredGroup], max_tokens: int
) -> list[ScoredGroup]:
    """First fit in the given order: add a group if the union of tree tokens stays within budget.

    The first group is always taken, even when alone over budget (a tree is never split).
    """
    chosen: list[ScoredGroup] = []
    used: dict[str, set[int]] = {}
    total = 0
    for g in groups:
        tree = trees[g.task_id]
        nodes = _group_nodes(tree, g)
        have = used.get(g.task_id, set())
        added = sum(len(tree.nodes[n].tokens) for n in nodes - have)
        if chosen and total + added > max_tokens:
            continue
        chosen.append(g)
        used[g.task_id] = have | nodes
        total += added
    return chosen


# Bytes one token can take in a chunk, at most: token id and position (varints, <= 5 each), loss mask
# (1), three weights and a log-prob (4 each), a policy version (int64 varint: -1 takes 10).
BYTES_PER_TOKEN = 40
# Bytes one node entry can take: offset and length (<= 5 each) and parent (-1 takes 10 as int32 varint).
BYTES_PER_NODE = 20
# Bytes of a chunk's fixed fields (ids, flags, counters, framing), not counting group ids.
CHUNK_OVERHEAD_BYTES = 512
DEFAULT_MAX_CHUNK_BYTES = 4 * 1024 * 1024
MIN_CHUNK_BYTES = 4096


def frame(chunk: trajectory_pb2.BatchChunk) -> bytes:
    """A chunk as the store keeps it: its length (8 bytes, little endian) then its bytes (one a row of
    traj_batch_chunks; one after the other in traj_batches.chunks for batches stored before those)."""
    b = chunk.SerializeToString()
    return struct.pack("<Q", len(b)) + b


def iter_framed(data: bytes | bytearray) -> Iterator[trajectory_pb2.BatchChunk]:
    """The chunks of framed bytes, decoded one at a time (the inverse of `frame`)."""
    i = 0
    view = memoryview(data)
    while i < len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        c = trajectory_pb2.BatchChunk()
        c.ParseFromString(bytes(view[i + 8 : i + 8 + n]))
        yield c
        i += 8 + n


class _ChunkBuilder:
    """Collects node pieces of one tree into chunks of at most `max_bytes` serialized bytes each
    (bounded by BYTES_PER_TOKEN / BYTES_PER_NODE), so packing holds one chunk's arrays at a time."""

    def __init__(self, max_bytes: int, emit: Callable[[trajectory_pb2.BatchChunk], None]) -> None:
        self.max_bytes = max_bytes
        self.emit = emit
        self.tree_index = -1
        self.tree_nodes = 0  # pieces of the current tree so far (tree node indices)
        self.tree_tokens = 0  # tokens of the current tree in chunks already emitted
        self.header: dict[str, Any] = {}
        self._reset(0)

    def _reset(self, extra_bytes: int) -> None:
        self.cols: dict[str, list[np.ndarray]] = {k: [] for k in _TOKEN_COLS}
        self.offsets: list[int] = []
        self.lengths: list[int] = []
        self.parents: list[int] = []
        self.first_node = self.tree_nodes
        self.num_tokens = 0
        self.bytes = CHUNK_OVERHEAD_BYTES + extra_bytes

    def start_tree(self, header: dict[str, Any]) -> None:
        self.tree_index += 1
        self.tree_nodes = self.tree_tokens = 0
        self.header = header
        self._reset(sum(len(g) + 4 for g in header["group_ids"]))

    def add_node(self, parent: int, arrays: dict[str, np.ndarray]) -> int:
        """Append a node (its arrays per token), cut into pieces across chunks; returns the tree node
        index of its last piece (the parent of its children)."""
        n = len(arrays["token_ids"])
        done = 0
        while True:
            space = self.max_bytes - self.bytes - BYTES_PER_NODE
            take = min(n - done, max(0, space // BYTES_PER_TOKEN))
            if space < 0 or (n > done and take == 0):
                if not self.lengths:  # an empty chunk without room: max_bytes is below one token
                    raise ValueError(f"max_chunk_bytes {self.max_bytes} cannot hold one token")
                self.flush(more=True)
                continue
            self.offsets.append(self.num_tokens)
            self.lengths.append(take)
            self.parents.append(parent)
            for k in _TOKEN_COLS:
                self.cols[k].append(arrays[k][done : done + take])
            self.num_tokens += take
            self.bytes += BYTES_PER_NODE + BYTES_PER_TOKEN * take
            parent = self.tree_nodes
            self.tree_nodes += 1
            done += take
            if done >= n:
                return parent

    def flush(self, more: bool) -> None:
        cat = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in self.cols.items()}
        first = self.first_node == 0
        chunk = trajectory_pb2.BatchChunk(
            token_ids=cat["token_ids"].astype(np.int64).tolist(),
            position_ids=cat["position_ids"].astype(np.int64).tolist(),
            node_offsets=self.offsets,
            node_lengths=self.lengths,
            node_parents=self.parents,
            loss_mask=cat["loss_mask"].astype(np.int32).tolist(),
            weight_pos=cat["weight_pos"].astype(np.float32).tolist(),
            weight_neg=cat["weight_neg"].astype(np.float32).tolist(),
            kl_weight=cat["kl_weight"].astype(np.float32).tolist(),
            behaviour_logprobs=cat["behaviour_logprobs"].astype(np.float32).tolist(),
            policy_versions=cat["policy_versions"].astype(np.int64).tolist(),
            tree_index=self.tree_index,
            first_node=self.first_node,
            first_token=self.tree_tokens,
            tree_continues=more,
            **(self.header if first else {}),
        )
        self.tree_tokens += self.num_tokens
        self.emit(chunk)
        self._reset(0)


_TOKEN_COLS = (
    "token_ids",
    "position_ids",
    "loss_mask",
    "weight_pos",
    "weight_neg",
    "kl_weight",
    "behaviour_logprobs",
    "policy_versions",
)


def pack(
    trees: dict[str, TaskTree],
    groups: list[ScoredGroup],
    *,
    batch_id: str | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    sink: Callable[[trajectory_pb2.BatchChunk], None] | None = None,
) -> TreeBatch:
    """Pack the given groups (caller chose them with ``select_groups``) into one batch of chunks of at
    most `max_chunk_bytes` serialized bytes each (a large tree spans several chunks, proto BatchChunk).

    Memory: one tree's generated-token arrays (``owned_positions``) plus one chunk's arrays at a time;
    with a `sink` each chunk is handed to it as soon as it is complete (the store writes it) and not
    kept in ``TreeBatch.chunks``, so the batch itself is never held whole.
    A task whose selected executions hold no stored call contributes no chunk, so a selection
    with nothing in it gives a batch with no chunks (the caller hands out no batch), never an error.
    """
    batch_id = batch_id or uuid.uuid4().hex
    if max_chunk_bytes < MIN_CHUNK_BYTES:
        raise ValueError(f"max_chunk_bytes must be at least {MIN_CHUNK_BYTES}, got {max_chunk_bytes}")
    by_task: dict[str, list[ScoredGroup]] = {}
    for g in groups:
        by_task.setdefault(g.task_id, []).append(g)

    normaliser = 0.0
    for g in groups:
        tree = trees[g.task_id]
        for e in g.executions:
            normaliser += e.multiplicity * e.dedup_weight * tree.generated_tokens(e.execution_id)
    normaliser = normaliser or 1.0

    out = TreeBatch(batch_id, [], [g.group_id for g in groups], 0, 0, 0, 0, -1, -1, normaliser)
    held: list[trajectory_pb2.BatchChunk] = []  # one chunk held back: `last` is known at the next

    def release(last: bool) -> None:
        c = held.pop()
        c.batch_id, c.chunk_index, c.last, c.normaliser = batch_id, out.num_chunks, last, normaliser
        out.num_chunks += 1
        size = c.ByteSize()
        out.max_chunk_bytes = max(out.max_chunk_bytes, size)
        if sink is None:
            out.chunks.append(c)
        else:
            sink(c)

    def emit(chunk: trajectory_pb2.BatchChunk) -> None:
        if held:
            release(False)
        held.append(chunk)

    builder = _ChunkBuilder(max_chunk_bytes, emit)
    vmin, vmax = np.iinfo(np.int64).max, -1
    for task_id in sorted(by_task):
        tree = trees[task_id]
        tgroups = by_task[task_id]
        execs = sorted((e for g in tgroups for e in g.executions), key=lambda e: e.execution_id)
        node_set = tree.nodes_of(e.execution_id for e in execs)
        if not node_set:
            continue
        # per node: (norm, owned arrays, advantages) of the executions that generated tokens in it
        owners: dict[int, list[tuple[float, tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray]]] = {}
        header: dict[str, Any] = {"num_paths": 0, "num_flat_tokens": 0, "reward_sum": 0.0}
        header["num_partial_paths"] = 0
        header["group_ids"] = sorted(g.group_id for g in tgroups)
        for e in execs:
            norm = e.multiplicity * e.dedup_weight / normaliser
            owned = tree.owned_positions(e.execution_id)
            adv = token_advantages(tree, e, owned)
            for nid, owned_arrays in owned.items():
                owners.setdefault(nid, []).append((norm, owned_arrays, adv[nid]))
            leaves = tree.leaves_of(e.execution_id)
            header["num_paths"] += len(leaves)
            header["num_flat_tokens"] += sum(leaf.end for leaf in leaves)
            out.paths.extend((e.execution_id, leaf.node_id) for leaf in leaves)
            header["num_partial_paths"] += e.num_partial
            header["reward_sum"] += e.reward_sum
        builder.start_tree(header)
        last_piece: dict[int, int] = {}
        for nid in _dfs_order(tree, node_set):
            node = tree.nodes[nid]
            size = len(node.tokens)
            loss_mask = np.zeros(size, dtype=bool)
            wpos = np.zeros(size, dtype=np.float64)
            wneg = np.zeros(size, dtype=np.float64)
            klw = np.zeros(size, dtype=np.float64)
            blp = np.zeros(size, dtype=LOGPROB_DTYPE)
            ver = np.full(size, -1, dtype=np.int64)
            for norm, (mask, lp, vv), node_adv in owners.pop(nid, []):
                w = node_adv * norm
                wpos[mask] += np.maximum(w, 0.0)[mask]
                wneg[mask] += np.minimum(w, 0.0)[mask]
                klw[mask] += norm
                fresh = mask & ~loss_mask
                blp[fresh] = lp[fresh]
                ver[fresh] = vv[fresh]
                loss_mask |= mask
            trained = ver[loss_mask]
            if len(trained):
                vmin, vmax = min(vmin, int(trained.min())), max(vmax, int(trained.max()))
            p = node.parent
            parent = last_piece[p.node_id] if p is not None and p.node_id >= 0 else -1
            arrays = {
                "token_ids": node.tokens,
                "position_ids": np.arange(node.start, node.end, dtype=np.int64),
                "loss_mask": loss_mask,
                "weight_pos": wpos,
                "weight_neg": wneg,
                "kl_weight": klw,
                "behaviour_logprobs": blp,
                "policy_versions": ver,
            }
            last_piece[nid] = builder.add_node(parent, arrays)
            out.num_tokens += size
        builder.flush(more=False)
        out.num_trees += 1
        out.num_flat_tokens += header["num_flat_tokens"]
        out.num_paths += header["num_paths"]
        out.num_partial_paths += header["num_partial_paths"]
    if held:
        release(True)
    out.min_policy_version = int(vmin) if vmax >= 0 else -1
    out.max_policy_version = int(vmax)
    return out


def token_advantages(
    tree: TaskTree,
    e: PackedExecution,
    owned: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> dict[int, np.ndarray]:
    """Advantage of every token of the owned nodes (node id -> float64 per token of the node).

    A generated token takes the advantage of the call that generated it, by the same rule as
    ``TaskTree.owned_positions`` (the lowest call_seq that generated the position); tokens the
    execution did not generate carry its ``advantage`` (they are masked out by the caller)."""
    out = {nid: np.full(len(mask), e.advantage, dtype=np.float64) for nid, (mask, _, _) in owned.items()}
    if not e.call_advantages:
        return out
    done = {nid: np.zeros(len(mask), dtype=bool) for nid, (mask, _, _) in owned.items()}
    calls = tree.calls_by_execution.get(e.execution_id, {})
    for seq in sorted(calls):
        rec = calls[seq]
        a = e.call_advantages.get(seq, e.advantage)
        n: Node | None = rec.end_node
        while n is not None and n.node_id >= 0 and n.end > rec.prompt_len:
            i0 = max(n.start, rec.prompt_len) - n.start
            fresh = ~done[n.node_id][i0:]
            out[n.node_id][i0:][fresh] = a
            done[n.node_id][i0:] = True
            n = n.parent
    return out


def _dfs_order(tree: TaskTree, node_set: set[int]) -> list[int]:
    roots = sorted(n for n in node_set if (p := tree.nodes[n].parent) is None or p.node_id < 0)
    order: list[int] = []
    stack = list(reversed(roots))
    while stack:
        nid = stack.pop()
        order.append(nid)
        kids = sorted(c.node_id for c in tree.nodes[nid].children.values() if c.node_id in node_set)
        stack.extend(reversed(kids))
    return order
