"""What `gyre bench xlong` checks after the run: trees against the minimal trie, Postgres bytes,
NATS health, and the pulled batch cut by the trainer's own splitter (micro-batches against the budget).
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa

from services.trajectory.synthetic import LongConfig, long_executions

_TRAJECTORY_TABLES_BUT_BATCHES = (
    "traj_tree_nodes",
    "traj_calls",
    "traj_executions",
    "traj_execution_groups",
    "traj_tasks",
    "traj_runs",
    "traj_scores",
    "traj_dedup_records",
    "traj_rejections",
)
_BATCH_TABLES = ("traj_batches", "traj_batch_chunks", "traj_batch_groups", "traj_batch_paths")


def check_trees(engine: sa.Engine, run_id: str, cfg: LongConfig) -> dict[str, Any]:
    """Are the stored trees exactly the minimal tries of the generated calls?

    - lossless: every generated call (regenerated here from the same seed) is stored: the tokens of
      the path to its end node are its prompt + completion, with its prompt length, log-probs,
      versions and agent;
    - minimal: read from traj_tree_nodes as stored, no two children of a node start with the same
      token, and every leaf is the end of a call (so no token is stored twice and none is extra).
    Together: the trees are the minimal tries of the call sequences."""
    from services.trajectory.store import TrajectoryStore
    from services.trajectory.tree import NodeIds

    trees, *_ = TrajectoryStore(engine, run_id).load(NodeIds())
    mismatched = checked = 0
    for ex in long_executions(cfg):
        tree = trees.get(ex.task_id)
        for c in ex.calls():
            checked += 1
            rec = None if tree is None else tree.calls.get((ex.execution_id, c.call_seq))
            ok = (
                rec is not None
                and rec.prompt_len == len(c.prompt)
                and rec.agent_id == c.agent_id
                and np.array_equal(rec.completion_logprobs, c.logprobs)
                and np.array_equal(rec.completion_versions, c.versions)
                and np.array_equal(tree.sequence(rec.end_node), np.concatenate([c.prompt, c.completion]))  # type: ignore[union-attr]
            )
            mismatched += not ok
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT node_id, parent_id, substring(tokens from 1 for 4) AS first, length(tokens) / 4 AS n "
                "FROM traj_tree_nodes WHERE run_id = :r"
            ),
            {"r": run_id},
        ).all()
        ends = {
            int(r[0])
            for r in conn.execute(
                sa.text("SELECT DISTINCT end_node_id FROM traj_calls WHERE run_id = :r"), {"r": run_id}
            )
        }
    firsts: set[tuple[int, bytes]] = set()
    parents = set()
    duplicate_first = 0
    for _node_id, parent_id, first, _ in rows:
        key = (-1 if parent_id is None else int(parent_id), bytes(first))
        duplicate_first += key in firsts
        firsts.add(key)
        if parent_id is not None:
            parents.add(int(parent_id))
    leaves = {int(r[0]) for r in rows} - parents
    leaves_not_call_ends = len(leaves - ends)
    stored_tokens = int(sum(int(r[3]) for r in rows))
    exact = mismatched == 0 and duplicate_first == 0 and leaves_not_call_ends == 0
    return {
        "trees_exact": exact,
        "calls_checked": checked,
        "calls_mismatched": mismatched,
        "sibling_nodes_sharing_a_first_token": duplicate_first,
        "leaves_not_call_ends": leaves_not_call_ends,
        "tree_tokens": stored_tokens,
        "tree_nodes": len(rows),
    }


def postgres_bytes(engine: sa.Engine) -> dict[str, int]:
    """Bytes on disk (tables, TOAST, indexes) of the trees and calls, and of the stored batches."""

    def size(tables: tuple[str, ...]) -> int:
        with engine.connect() as conn:
            return int(
                sum(
                    conn.execute(sa.text("SELECT pg_total_relation_size(:t)"), {"t": t}).scalar() or 0
                    for t in tables
                )
            )

    return {
        "postgres_tree_bytes": size(_TRAJECTORY_TABLES_BUT_BATCHES),
        "postgres_batch_bytes": size(_BATCH_TABLES),
    }


def nats_health(monitoring_url: str | None, nats_log: Path, service_log: Path) -> dict[str, Any]:
    """Slow consumers as nats-server counts them (/varz, and its log), and the disconnections the
    trajectory service's bus logged (gyre.bus: 'disconnected from')."""
    out: dict[str, Any] = {}
    if monitoring_url:
        with urllib.request.urlopen(f"{monitoring_url}/varz", timeout=10) as r:
            varz = json.load(r)
        out["nats_slow_consumers"] = int(varz.get("slow_consumers", 0))
    text = nats_log.read_text(errors="replace") if nats_log.is_file() else ""
    out["nats_log_slow_consumer_lines"] = len(re.findall(r"Slow Consumer", text, re.IGNORECASE))
    svc = service_log.read_text(errors="replace") if service_log.is_file() else ""
    out["service_nats_disconnects"] = len(re.findall(r"disconnected from", svc))
    return out


def path_lengths(node_lengths: list[int], node_parents: list[int]) -> list[int]:
    """Tokens of every root-to-leaf path of a packed batch (node pieces, parents before children)."""
    total = [0] * len(node_lengths)
    has_child = [False] * len(node_lengths)
    for i, (n, p) in enumerate(zip(node_lengths, node_parents, strict=True)):
        total[i] = n + (total[p] if p >= 0 else 0)
        if p >= 0:
            has_child[p] = True
    return [t for t, c in zip(total, has_child, strict=True) if not c]


def check_micro_batches(batch: Any, budget: int) -> tuple[dict[str, Any], list[Any]]:
    """The pulled batch cut by the trainer's own splitter (PackedBatch.micro_batches) at `budget`
    tokens: each micro-batch against the budget, every trained token trained once, and the paths
    longer than the budget (a single path is not split along the sequence yet)."""
    micro = batch.micro_batches(budget)
    sizes = [m.num_tokens for m in micro]
    paths = path_lengths(batch.node_lengths, batch.node_parents)
    longest = max(paths, default=0)
    trained = int(batch.loss_mask.sum())
    trained_parts = sum(int(m.loss_mask.sum()) for m in micro)
    over = [s for s in sizes if s > budget]
    return {
        "micro_batch_budget_tokens": budget,
        "micro_batches": len(micro),
        "micro_batch_max_tokens": max(sizes),
        "micro_batches_over_budget": len(over),
        # the splitter's rule: a part holds at most max(budget, the tree's longest path)
        "micro_batches_within_splitter_bound": all(s <= max(budget, longest) for s in sizes),
        "paths": len(paths),
        "longest_path_tokens": longest,
        "paths_over_budget": sum(1 for p in paths if p > budget),
        "trained_tokens_once": trained == trained_parts,
        "recomputed_context_tokens": sum(sizes) - batch.num_tokens,
    }, micro


def nodes_kernel_mask_bytes(micro: Any) -> int:
    """Bytes of the additive masks the CPU tree-attention kernel ('nodes', gyre/model/attention.py)
    holds for one micro-batch: n x K float32 per node (its n queries over its K visible keys)."""
    total = 0
    visible = [0] * len(micro.node_lengths)
    for i, (n, p) in enumerate(zip(micro.node_lengths, micro.node_parents, strict=True)):
        visible[i] = n + (visible[p] if p >= 0 else 0)
        if p >= 0:
            total += n * visible[i] * 4
    return total
