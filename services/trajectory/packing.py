"""Tree-packed batches: whole trees of scored groups under a token budget, as BatchChunk arrays.

Layout (the contract in proto/gyre/v1/trajectory.proto, BatchChunk): one chunk per task tree;
the nodes of the selected executions' paths are laid out node by node in depth-first pre-order
(children by node id), ``node_parents`` index into the same chunk, ``position_ids`` are each
token's position in its original sequence (``node.start + i``).

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

import uuid
from dataclasses import dataclass, field

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


def pack(trees: dict[str, TaskTree], groups: list[ScoredGroup], *, batch_id: str | None = None) -> TreeBatch:
    """Pack the given groups (caller chose them with ``select_groups``) into one batch.

    A task whose selected executions hold no stored call contributes no chunk, so a selection
    with nothing in it gives a batch with no chunks (the caller hands out no batch), never an error.
    """
    batch_id = batch_id or uuid.uuid4().hex
    by_task: dict[str, list[ScoredGroup]] = {}
    for g in groups:
        by_task.setdefault(g.task_id, []).append(g)

    owned: dict[str, dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    normaliser = 0.0
    for g in groups:
        tree = trees[g.task_id]
        for e in g.executions:
            owned[e.execution_id] = tree.owned_positions(e.execution_id)
            num = sum(int(m.sum()) for m, _, _ in owned[e.execution_id].values())
            normaliser += e.multiplicity * e.dedup_weight * num
    normaliser = normaliser or 1.0

    chunks: list[trajectory_pb2.BatchChunk] = []
    totals = {"tokens": 0, "flat": 0, "paths": 0, "partial": 0}
    vmin, vmax = np.iinfo(np.int64).max, -1
    paths: list[tuple[str, int]] = []
    for task_id in sorted(by_task):
        tree = trees[task_id]
        tgroups = by_task[task_id]
        execs = sorted((e for g in tgroups for e in g.executions), key=lambda e: e.execution_id)
        node_set = tree.nodes_of(e.execution_id for e in execs)
        if not node_set:
            continue
        order = _dfs_order(tree, node_set)
        index = {nid: i for i, nid in enumerate(order)}
        lengths = np.array([len(tree.nodes[n].tokens) for n in order], dtype=np.int32)
        offsets = np.zeros(len(order), dtype=np.int32)
        if len(order) > 1:
            offsets[1:] = np.cumsum(lengths)[:-1]
        size = int(lengths.sum())
        tokens = np.concatenate([tree.nodes[n].tokens for n in order])
        positions = np.concatenate(
            [np.arange(tree.nodes[n].start, tree.nodes[n].end, dtype=np.int32) for n in order]
        )
        parents = np.array(
            [
                index[p.node_id] if (p := tree.nodes[n].parent) is not None and p.node_id >= 0 else -1
                for n in order
            ],
            dtype=np.int32,
        )
        loss_mask = np.zeros(size, dtype=np.int32)
        wpos = np.zeros(size, dtype=np.float64)
        wneg = np.zeros(size, dtype=np.float64)
        klw = np.zeros(size, dtype=np.float64)
        blp = np.zeros(size, dtype=LOGPROB_DTYPE)
        ver = np.full(size, -1, dtype=np.int64)
        num_paths = flat = partial = 0
        reward_sum = 0.0
        for e in execs:
            norm = e.multiplicity * e.dedup_weight / normaliser
            adv = token_advantages(tree, e, owned[e.execution_id])
            for nid, (mask, lp, vv) in owned[e.execution_id].items():
                o = int(offsets[index[nid]])
                sl = slice(o, o + len(mask))
                w = adv[nid] * norm
                wpos[sl][mask] += np.maximum(w, 0.0)[mask]
                wneg[sl][mask] += np.minimum(w, 0.0)[mask]
                klw[sl][mask] += norm
                fresh = mask & (loss_mask[sl] == 0)
                blp[sl][fresh] = lp[fresh]
                ver[sl][fresh] = vv[fresh]
                loss_mask[sl][mask] = 1
            leaves = tree.leaves_of(e.execution_id)
            num_paths += len(leaves)
            flat += sum(leaf.end for leaf in leaves)
            paths.extend((e.execution_id, leaf.node_id) for leaf in leaves)
            partial += e.num_partial
            reward_sum += e.reward_sum
        trained = ver[loss_mask == 1]
        if len(trained):
            vmin, vmax = min(vmin, int(trained.min())), max(vmax, int(trained.max()))
        chunk = trajectory_pb2.BatchChunk(
            batch_id=batch_id,
            token_ids=tokens.tolist(),
            position_ids=positions.tolist(),
            node_offsets=offsets.tolist(),
            node_lengths=lengths.tolist(),
            node_parents=parents.tolist(),
            loss_mask=loss_mask.tolist(),
            weight_pos=wpos.astype(np.float32).tolist(),
            weight_neg=wneg.astype(np.float32).tolist(),
            kl_weight=klw.astype(np.float32).tolist(),
            behaviour_logprobs=blp.tolist(),
            policy_versions=ver.tolist(),
            num_paths=num_paths,
            num_flat_tokens=flat,
            group_ids=sorted(g.group_id for g in tgroups),
            reward_sum=reward_sum,
            num_partial_paths=partial,
        )
        chunks.append(chunk)
        totals["tokens"] += size
        totals["flat"] += flat
        totals["paths"] += num_paths
        totals["partial"] += partial
    for i, c in enumerate(chunks):
        c.chunk_index = i
        c.last = i == len(chunks) - 1
    return TreeBatch(
        batch_id=batch_id,
        chunks=chunks,
        group_ids=[g.group_id for g in groups],
        num_tokens=totals["tokens"],
        num_flat_tokens=totals["flat"],
        num_paths=totals["paths"],
        num_partial_paths=totals["partial"],
        min_policy_version=int(vmin) if vmax >= 0 else -1,
        max_policy_version=int(vmax),
        normaliser=normaliser,
        paths=paths,
    )


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
