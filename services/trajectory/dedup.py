"""Deduplication of a group's executions: exact merges and near-duplicate down-weighting.

Exact: executions whose every call has the same tokens (same end node and prompt length for
every call_seq) are merged into one representative with multiplicity k. Training the
representative with weight k times the mean of the members' advantages gives exactly the loss
of training each member, so nothing is lost and group statistics are unchanged.

Near: representatives whose action sequences (all completion tokens, as k-token shingles) have
an estimated Jaccard similarity at or above ``threshold`` (MinHash + LSH from ``datasketch``) form a
cluster; each member of a cluster of size c gets ``dedup_weight = 1 / c`` (down-weighted, never
dropped). If that would leave the whole group as one cluster, no member is down-weighted: a group
is never reduced to identical members. Every decision becomes a ``DedupDecision`` (stored in
Postgres by the service and counted in stats).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from datasketch import MinHash, MinHashLSH

from services.trajectory.tree import TaskTree


@dataclass(slots=True)
class DedupDecision:
    execution_id: str
    kind: str  # "exact" (merged into other), "near" (down-weighted), "near_kept" (similar but kept at 1)
    other_execution_id: str
    similarity: float
    weight: float
    reason: str


@dataclass(slots=True)
class GroupDedup:
    members: dict[str, list[str]]  # representative -> every execution it stands for (itself first)
    weights: dict[str, float]  # representative -> dedup weight in (0, 1]
    decisions: list[DedupDecision] = field(default_factory=list)

    @property
    def num_exact_merged(self) -> int:
        return sum(1 for d in self.decisions if d.kind == "exact")

    @property
    def num_near_duplicates(self) -> int:
        return sum(1 for d in self.decisions if d.kind == "near")


def shingle_hashes(tokens: np.ndarray, k: int) -> np.ndarray:
    """Distinct 32-bit hashes of every k-token window (a polynomial hash, vectorised)."""
    t = np.asarray(tokens, dtype=np.uint64)
    if len(t) < k:
        t = np.pad(t, (0, k - len(t)), constant_values=0xFFFF)
    win = np.lib.stride_tricks.sliding_window_view(t, k)
    h = np.zeros(len(win), dtype=np.uint64)
    for j in range(k):
        h = (h * np.uint64(1_000_003) + win[:, j] + np.uint64(j * 7919)) & np.uint64(0xFFFFFFFFFFFF)
    h ^= h >> np.uint64(17)
    return np.unique(h & np.uint64(0xFFFFFFFF))


MINHASH_SLICE = 16_384  # shingles hashed at once (num_perm x 8 bytes each)


def minhash_of(tokens: np.ndarray, *, k: int, num_perm: int) -> MinHash:
    m = MinHash(num_perm=num_perm, hashfunc=int)
    hashes = shingle_hashes(tokens, k)
    # In slices: update_batch holds num_perm x n uint64 (1 GiB for the million shingles of a long
    # execution); the sketch is a minimum, so slices give the same one.
    for i in range(0, len(hashes), MINHASH_SLICE):
        m.update_batch(hashes[i : i + MINHASH_SLICE].tolist())
    return m


def dedup_group(
    tree: TaskTree,
    execution_ids: list[str],
    *,
    threshold: float = 0.9,
    num_perm: int = 128,
    shingle_size: int = 4,
) -> GroupDedup:
    """Exact merges then near-duplicate weights for one group (deterministic: order by execution id)."""
    decisions: list[DedupDecision] = []
    by_sig: dict[tuple[tuple[int, int, int], ...], str] = {}
    members: dict[str, list[str]] = {}
    for eid in sorted(execution_ids):
        sig = tree.signature(eid)
        rep = by_sig.get(sig)
        if rep is None or not sig:
            by_sig[sig] = eid
            members[eid] = [eid]
        else:
            members[rep].append(eid)
            decisions.append(
                DedupDecision(eid, "exact", rep, 1.0, 0.0, "identical tokens in every call; merged")
            )
    reps = list(members)
    weights = {r: 1.0 for r in reps}
    if len(reps) < 2 or threshold >= 1.0:
        return GroupDedup(members, weights, decisions)

    sketches = {r: minhash_of(tree.completion_tokens(r), k=shingle_size, num_perm=num_perm) for r in reps}
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    parent = {r: r for r in reps}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    best: dict[str, tuple[str, float]] = {}
    for r in reps:
        for other in lsh.query(sketches[r]):
            sim = float(sketches[r].jaccard(sketches[other]))
            if sim >= threshold:
                parent[find(r)] = find(other)
                if sim > best.get(r, ("", -1.0))[1]:
                    best[r] = (other, sim)
        lsh.insert(r, sketches[r])
    clusters: dict[str, list[str]] = {}
    for r in reps:
        clusters.setdefault(find(r), []).append(r)
    keep_all = len(clusters) == 1
    for cluster in clusters.values():
        if len(cluster) < 2:
            continue
        for r in cluster:
            other, sim = best.get(r) or next(
                ((o, best[o][1]) for o in cluster if o in best and best[o][0] == r), (cluster[0], threshold)
            )
            if keep_all:
                decisions.append(
                    DedupDecision(
                        r, "near_kept", other, sim, 1.0, "whole group is one near-duplicate cluster; kept"
                    )
                )
            else:
                weights[r] = 1.0 / len(cluster)
                decisions.append(
                    DedupDecision(
                        r, "near", other, sim, weights[r], f"near-duplicate cluster of {len(cluster)}"
                    )
                )
    return GroupDedup(members, weights, decisions)
