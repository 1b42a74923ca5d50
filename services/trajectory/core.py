"""The trajectory service's state and operations, independent of transport (NATS, gRPC).

`TrajectoryCore` builds three parts, each readable alone and called directly (`core.ingest`,
`core.scoring`, `core.batching`; `core.state` is what they share), over one in-memory state
(services/trajectory/state.py) and the Postgres store (services/trajectory/store.py):

- ingest (services/trajectory/ingest.py): steps -> task trees, execution events -> executions;
- scoring (services/trajectory/group_scoring.py): ready groups -> scores, dedup, advantages;
- batching (services/trajectory/batching.py): scored groups -> packed batches -> PullBatch / AckBatch.

Every change of the state is made under one ``asyncio.Lock``, memory first, then one Postgres
transaction queued on the `CommitQueue` (commits run in the order memory changed; a failed commit
reloads the whole state from Postgres, so memory never holds what Postgres does not, and the error
propagates: the NATS batch is then redelivered). On start the state is loaded from Postgres, so a
restarted service continues where the old one stopped.

Loops and what they wait on::

    NATS steps / gRPC IngestSteps --ingest_steps--> trees + traj_calls   (commit, then ack)
    NATS executions -------------ingest_executions--> traj_executions     (commit, then ack)
    poll (every ready_poll_s) --> score ready groups --> GroupScoredEvent
                              --> build batch when enough scored tokens --> BatchReadyEvent
    PullBatch --> claim a ready batch (or pack one now) --> mark delivered --> stream chunks
    PullBatch(stream_part) --> the same for one part of a streamed step: packed as soon as one
                               scored group fits the step's remaining budget (batching.py)
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import sqlalchemy as sa

from gyre.errors import NotFound
from gyre.v1 import trajectory_pb2
from services.trajectory.batching import Batcher
from services.trajectory.config import TrajectoryConfig
from services.trajectory.group_scoring import GroupScoring
from services.trajectory.ingest import StepIngest, validate_step
from services.trajectory.scoring import load_scorer
from services.trajectory.state import (
    CommitQueue,
    TrajectoryState,
    progress_from_pb,
)
from services.trajectory.store import TrajectoryStore
from services.trajectory.tree import TaskTree

__all__ = ["TrajectoryCore", "progress_from_pb", "typed_stats", "validate_step"]


class TrajectoryCore:
    """Ingest, scoring and batching of one run, sharing one state, one lock and one commit queue."""

    def __init__(self, run_id: str, cfg: TrajectoryConfig, engine: sa.Engine) -> None:
        self.run_id = run_id
        self.cfg = cfg
        self.store = TrajectoryStore(engine, run_id)
        self.state = TrajectoryState()
        self.lock = asyncio.Lock()
        self.counters: Counter[str] = Counter()
        self.commits = CommitQueue(self.state, self.store, self.lock)
        scorer = load_scorer(cfg.scorer, cfg.reward_min, cfg.reward_max, cfg.partial_scale)
        self.ingest = StepIngest(run_id, self.state, self.store, self.commits, scorer, self.counters)
        self.scoring = GroupScoring(run_id, cfg, self.state, self.store, self.commits, scorer, self.counters)
        self.batching = Batcher(run_id, cfg, self.state, self.store, self.commits, self.counters)

    def load(self) -> None:
        """(Re)build the in-memory state from Postgres (sync; call at start or via to_thread)."""
        self.state.load(self.store)

    # ------------------------------------------------------------------ queries
    def export(self, execution_id: str) -> Iterator[trajectory_pb2.ExportExecutionResponse]:
        """Every stored call of one execution, exactly as it was sent, one message per call in call_seq
        order, each rebuilt when it is asked for (a 1M-token execution never becomes one message);
        NotFound (raised here, before the first message) if there is none."""
        info = self.state.executions.get(execution_id)
        tree = self.state.trees.get(info.task_id) if info else None
        if info is None or tree is None or execution_id not in tree.calls_by_execution:
            raise NotFound(f"execution {execution_id!r} has no stored calls in run {self.run_id!r}")
        return self._export_calls(tree, execution_id, info.task_id, info.group_id)

    @staticmethod
    def _export_calls(
        tree: TaskTree, execution_id: str, task_id: str, group_id: str
    ) -> Iterator[trajectory_pb2.ExportExecutionResponse]:
        calls = tree.calls_by_execution.get(execution_id, {})
        for seq in sorted(calls):
            if (rec := calls.get(seq)) is None:
                continue
            c = tree.export_call(rec)
            yield trajectory_pb2.ExportExecutionResponse(
                execution_id=execution_id,
                task_id=task_id,
                group_id=group_id,
                calls=[
                    trajectory_pb2.ExportedCall(
                        call_seq=c.call_seq,
                        prompt_token_ids=c.prompt_token_ids.tolist(),
                        completion_token_ids=c.completion_token_ids.tolist(),
                        completion_logprobs=c.completion_logprobs.tolist(),
                        completion_versions=c.completion_versions.tolist(),
                        agent_id=c.agent_id,
                    )
                ],
            )

    async def stats(self) -> dict[str, float]:
        """Counters since start, sizes of the in-memory state and row counts in Postgres."""
        out = {k: float(v) for k, v in self.counters.items()}
        st = self.state
        out["tree_tokens"] = float(sum(t.num_tokens for t in st.trees.values()))
        out["tree_nodes"] = float(sum(len(t.nodes) for t in st.trees.values()))
        out["executions"] = float(len(st.executions))
        for state in ("open", "scored", "batched", "dropped_stale", "rejected", "empty", "quarantined"):
            out[f"groups_state_{state}"] = float(sum(1 for g in st.groups.values() if g.state == state))
        out.update(await asyncio.to_thread(self.store.counts))
        return out


def typed_stats(values: dict[str, float], latest_weights_version: int) -> trajectory_pb2.TrajectoryStats:
    """The fixed figures of `TrajectoryCore.stats()` as the typed message clients read (a figure
    that has no counter yet, e.g. no batch acked so far, is 0)."""

    def n(key: str) -> int:
        return int(values.get(key, 0.0))

    return trajectory_pb2.TrajectoryStats(
        tree_tokens=n("tree_tokens"),
        tree_nodes=n("tree_nodes"),
        executions=n("executions"),
        groups_open=n("groups_state_open"),
        groups_scored=n("groups_state_scored"),
        groups_batched=n("groups_state_batched"),
        groups_dropped_stale=n("groups_state_dropped_stale"),
        groups_rejected=n("groups_state_rejected"),
        groups_empty=n("groups_state_empty"),
        stored_calls=n("stored_calls"),
        stored_nodes=n("stored_nodes"),
        rejections=n("rejections"),
        dedup_records=n("dedup_records"),
        batches_ready=n("batches_ready"),
        batches_delivered=n("batches_delivered"),
        batches_acked=n("batches_acked"),
        batches_quarantined=n("batches_quarantined"),
        latest_weights_version=latest_weights_version,
    )
