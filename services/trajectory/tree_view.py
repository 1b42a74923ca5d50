"""Each execution group's branch tree as a JSON document, for viewers (`gyre ui`'s tree viewer).

A view holds the nodes of one group: the union of the root-to-node paths of every call of every
member (`TaskTree.nodes_of`), so its node count is the trajectory store's for that group. Per node:
its token ids, its start position, the executions whose calls pass through it, the calls that end
there, the per-token log-prob and policy version of the tokens a member generated there (None for
tokens it did not generate: prompts, environment observations), and the kind of the branch that
starts at it:

- `root`: the first node of a sequence;
- `subagent`: the first call through it is a sub-agent's (agent_id other than "main");
- the call's own `context_event` (`compaction`, `strip_reasoning`, `retry`, ...) when the branch
  starts inside that call's prompt (the agent rewrote its history);
- `prompt`: it starts inside a prompt, with no context event named (the environment said
  something else);
- `sample`: it starts inside a completion (the policy sampled another token there);
- `continue`: its parent has no other child (a split where a call ended, not a branch).

Also per group: its state and reward statistics, each member's ending, score, advantage and dedup
representative, and every dedup decision (exact merges, near-duplicate down-weighting). Read-only:
it reads the store and changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from gyre.store import session_scope
from services.trajectory import models as m
from services.trajectory.state import TrajectoryState
from services.trajectory.store import TrajectoryStore
from services.trajectory.tree import Node, TaskTree

TREES_FILE = "trees.jsonl"


def _call_meta(engine: sa.Engine, run_id: str) -> dict[tuple[str, int], tuple[str, str]]:
    """(execution_id, call_seq) -> (agent_id, context_event) of every stored call."""
    with session_scope(engine) as s:
        rows = s.execute(
            sa.select(m.Call.execution_id, m.Call.call_seq, m.Call.agent_id, m.Call.context_event).where(
                m.Call.run_id == run_id
            )
        ).all()
    return {(r.execution_id, r.call_seq): (r.agent_id, r.context_event or "") for r in rows}


def _rows_by_group(engine: sa.Engine, run_id: str, model: Any) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    with session_scope(engine) as s:
        for row in s.scalars(sa.select(model).where(model.run_id == run_id)):
            d = {
                c.name: getattr(row, c.name)
                for c in model.__table__.columns
                if c.name not in ("run_id", "id")
            }
            out.setdefault(str(d["group_id"]), []).append(d)
    return out


def _branch_kind(
    node: Node, first_call: tuple[str, int, int] | None, meta: dict[tuple[str, int], tuple[str, str]]
) -> str:
    parent = node.parent
    if parent is None or parent.node_id < 0:
        return "root"
    if len(parent.children) < 2:
        return "continue"
    if first_call is None:
        return "sample"
    execution_id, call_seq, prompt_len = first_call
    agent_id, context_event = meta.get((execution_id, call_seq), ("main", ""))
    if agent_id != "main":
        return "subagent"
    if node.start < prompt_len:
        return context_event or "prompt"
    return "sample"


def group_view(
    tree: TaskTree,
    group_id: str,
    members: Iterable[str],
    meta: dict[tuple[str, int], tuple[str, str]],
) -> dict[str, Any]:
    """The nodes of one group (see the module docstring), parents before children."""
    member_ids = sorted(members)
    node_ids = tree.nodes_of(member_ids)
    through: dict[int, set[str]] = {n: set() for n in node_ids}
    first_call: dict[int, tuple[str, int, int]] = {}
    call_ends: dict[int, list[dict[str, Any]]] = {}
    for eid in member_ids:
        for seq, rec in sorted(tree.calls_by_execution.get(eid, {}).items()):
            agent_id, context_event = meta.get((eid, seq), (rec.agent_id, ""))
            call_ends.setdefault(rec.end_node.node_id, []).append(
                {
                    "execution_id": eid,
                    "call_seq": seq,
                    "agent_id": agent_id,
                    "context_event": context_event,
                    "prompt_len": rec.prompt_len,
                }
            )
            for n in rec.end_node.path():
                through[n.node_id].add(eid)
                first_call.setdefault(n.node_id, (eid, seq, rec.prompt_len))
    logprobs: dict[int, list[float | None]] = {}
    versions: dict[int, list[int | None]] = {}
    for eid in member_ids:
        for nid, (mask, lp, ver) in tree.owned_positions(eid).items():
            size = len(mask)
            lps = logprobs.setdefault(nid, [None] * size)
            vs = versions.setdefault(nid, [None] * size)
            for i in range(size):
                if mask[i] and lps[i] is None:
                    lps[i], vs[i] = float(lp[i]), int(ver[i])
    nodes = []
    for nid in sorted(node_ids, key=lambda n: (tree.nodes[n].start, n)):
        node = tree.nodes[nid]
        size = len(node.tokens)
        node_versions = sorted({v for v in versions.get(nid, []) if v is not None})
        nodes.append(
            {
                "node_id": nid,
                "parent_id": node.parent.node_id
                if node.parent is not None and node.parent.node_id >= 0
                else None,
                "start": node.start,
                "token_ids": node.tokens.tolist(),
                "logprobs": logprobs.get(nid, [None] * size),
                "versions": versions.get(nid, [None] * size),
                "policy_versions": node_versions,
                "executions": sorted(through[nid]),
                "call_ends": call_ends.get(nid, []),
                "branch_kind": _branch_kind(node, first_call.get(nid), meta),
            }
        )
    return {"group_id": group_id, "task_id": tree.task_id, "num_nodes": len(nodes), "nodes": nodes}


_STORE_NODE_COUNTS = sa.text(
    """
    WITH RECURSIVE up(group_id, node_id, parent_id) AS (
        SELECT c.group_id, n.node_id, n.parent_id
        FROM traj_calls c JOIN traj_tree_nodes n ON n.node_id = c.end_node_id
        WHERE c.run_id = :run_id
      UNION
        SELECT up.group_id, p.node_id, p.parent_id
        FROM traj_tree_nodes p JOIN up ON p.node_id = up.parent_id
    )
    SELECT group_id, count(DISTINCT node_id) AS num_nodes FROM up GROUP BY group_id
    """
)


def store_node_counts(engine: sa.Engine, run_id: str) -> dict[str, int]:
    """Nodes on the paths of each group's calls, counted by Postgres itself (a recursive query over
    traj_calls and traj_tree_nodes, independent of the in-memory tree walk of `group_view`)."""
    with session_scope(engine) as s:
        return {str(r.group_id): int(r.num_nodes) for r in s.execute(_STORE_NODE_COUNTS, {"run_id": run_id})}


def iter_group_views(engine: sa.Engine, run_id: str) -> Iterator[dict[str, Any]]:
    """Every group of the run with stored calls, with scores and dedup decisions (reads Postgres)."""
    state = TrajectoryState()
    state.load(TrajectoryStore(engine, run_id))
    meta = _call_meta(engine, run_id)
    counted = store_node_counts(engine, run_id)
    scores = _rows_by_group(engine, run_id, m.Score)
    dedup = _rows_by_group(engine, run_id, m.DedupRecord)
    with session_scope(engine) as s:
        group_rows = {
            g.group_id: g
            for g in s.scalars(sa.select(m.ExecutionGroup).where(m.ExecutionGroup.run_id == run_id))
        }
    for gid in sorted(state.groups):
        g = state.groups[gid]
        tree = state.trees.get(g.task_id)
        if tree is None or not any(e in tree.calls_by_execution for e in g.members):
            continue
        view = group_view(tree, gid, g.members, meta)
        row = group_rows.get(gid)
        view["state"] = g.state
        view["store_num_nodes"] = counted.get(gid, 0)
        view["reward_mean"] = row.reward_mean if row is not None else None
        view["reward_std"] = row.reward_std if row is not None else None
        score_of = {s["execution_id"]: s for s in scores.get(gid, [])}
        view["executions"] = [
            {
                "execution_id": eid,
                "ending": state.executions[eid].ending.value if eid in state.executions else "unknown",
                "num_calls": len(tree.calls_by_execution.get(eid, {})),
                **{k: v for k, v in score_of.get(eid, {}).items() if k not in ("execution_id", "group_id")},
            }
            for eid in sorted(g.members)
        ]
        view["dedup"] = [{k: v for k, v in d.items() if k != "group_id"} for d in dedup.get(gid, [])]
        yield view


def write_group_views(engine: sa.Engine, run_id: str, path: Path) -> int:
    """Write every group's view as one JSON line to `path` (replaced atomically); return #groups."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    n = 0
    with tmp.open("w", encoding="utf-8") as fh:
        for view in iter_group_views(engine, run_id):
            fh.write(json.dumps(view, separators=(",", ":")) + "\n")
            n += 1
    tmp.replace(path)
    return n
