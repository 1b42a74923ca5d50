"""Ingest: step events become calls in the task trees; execution events record how executions end.

A batch of steps (one JetStream fetch, or one IngestSteps call) goes through three stages::

    decode + validate   (worker thread, no shared state)   -> arrays, or a rejection with its reason
    match + insert      (event loop, under the state lock)  -> trees changed in memory, a StepBatch
    commit              (worker thread, CommitQueue)        -> one Postgres transaction, then the ack

The lock is released once the batch is queued for commit, so the next batch is decoded and matched
while this one is written: one database round trip per batch, and the event loop never waits on it.
``ingest_steps`` returns only after its own commit, so a JetStream batch is acked only once stored;
``insert_steps`` returns once inserted, with a future for the commit (the NATS consumer acks when it
completes and meanwhile inserts the next batch).

Idempotence: a step is keyed by (execution_id, call_seq); one already held is counted as a
duplicate and changes nothing. A compact step whose base call is not stored yet is counted as
waiting (the caller has it redelivered). Invalid steps are stored as rejections with their reason,
and the rest of their batch is stored. Execution end events keep the first ending.

Compact steps (gyre.bus.steps) cost their new tokens, not their context: the prompt is never rebuilt.
Its CRC-32 continues the CRC kept for the base call's path (`tree.prefix_crc32`: the nodes above the
base length, plus part of one node) and is checked with the length against the producer's; the call
is inserted from the last node boundary of that path (`TaskTree.insert_call_after`). A reference that cannot be resolved - not an
earlier call, a base length beyond the base call, a rebuilt prompt that fails its check, or a base
call still missing after `BASE_WAIT_LIMIT` deliveries - is never stored approximately: the step is
rejected with the reason and handed to `on_unresolved` (the service dead-letters it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gyre.bus.steps import prompt_sum_problem, reference_problem, token_crc32
from gyre.errors import InvalidArgument
from gyre.v1 import events_pb2, trajectory_pb2
from gyre.validation import step_problem
from services.trajectory.scoring import Ending, Outcome, ProgressSignals, Scorer
from services.trajectory.state import (
    CommitQueue,
    ExecInfo,
    TrajectoryState,
    progress_from_json,
    progress_from_pb,
    progress_to_json,
)
from services.trajectory.store import NewCall, StepBatch, TrajectoryStore
from services.trajectory.tree import (
    LOGPROB_DTYPE,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    CallRecord,
    Node,
    TaskTree,
    prefix_crc32,
)

log = logging.getLogger("gyre.trajectory")

_ENDINGS = {
    events_pb2.ExecutionEvent.KIND_FINISHED: Ending.FINISHED,
    events_pb2.ExecutionEvent.KIND_TRUNCATED: Ending.TRUNCATED,
    events_pb2.ExecutionEvent.KIND_FAILED: Ending.FAILED,
}

Rejection = tuple[str, str, str, bytes]  # kind, key, error, payload
# Tokens of the latest call of each recent execution kept by StepIngest (4 bytes each): 64 MiB.
REMEMBERED_TOKENS = 16 * 1024 * 1024
# Deliveries a compact step may wait for its base call before it is refused as unresolvable (the steps
# consumer's redelivery delay doubles from 0.5 s up to STEPS_MAX_NAK_DELAY_S: about eight minutes).
BASE_WAIT_LIMIT = 240
# Longest redelivery delay of a steps batch (s). Short: a base call is usually stored within a batch
# or two, and after a restart redeliveries arrive out of order in chains (a compact step waiting on a
# base that waits on its own); at the bus default of 30 s such a chain took minutes to drain and a
# `gyre chaos --resume` run ended with 12 steps not stored yet.
STEPS_MAX_NAK_DELAY_S = 2.0
# Called with a step whose compact reference cannot be resolved and the reason (after the commit).
Unresolved = Callable[[events_pb2.StepEvent, str], Awaitable[None]]


def validate_step(step: events_pb2.StepEvent) -> np.ndarray:
    """Raise InvalidArgument naming the problem; return the completion log-probs (float32) of a valid
    step. "Valid" is `gyre.validation.step_problem`, the one definition the producer and the
    trajectory's validation stage also apply (the vocabulary and version checks run there, with
    the run's limits; this is the store's last line of defence on content alone)."""
    problem = step_problem(step)
    if problem is not None:
        raise InvalidArgument(problem.reason)
    return np.array(step.completion_logprobs, dtype=LOGPROB_DTYPE)


@dataclass(slots=True)
class DecodedStep:
    """A valid step with its token lists as arrays (the decode stage's output)."""

    step: events_pb2.StepEvent
    prompt: np.ndarray  # TOKEN_DTYPE; the new tokens only when the step is compact
    completion: np.ndarray  # TOKEN_DTYPE
    logprobs: np.ndarray  # LOGPROB_DTYPE, natural log, <= 0
    versions: np.ndarray  # VERSION_DTYPE, policy version of each completion token
    progress: ProgressSignals


def _rejection(step: events_pb2.StepEvent, error: str) -> Rejection:
    return ("step", f"{step.execution_id}.{step.call_seq}", error, step.SerializeToString())


def decode_steps(steps: list[events_pb2.StepEvent], run_id: str) -> tuple[list[DecodedStep], list[Rejection]]:
    """Validate every step and convert its lists to arrays; pure (touches no shared state).

    Valid steps come back in call order within an execution (a compact step's base call first).
    """
    decoded: list[DecodedStep] = []
    rejected: list[Rejection] = []
    for step in sorted(steps, key=lambda st: (st.execution_id, st.call_seq)):
        try:
            logprobs = validate_step(step)
            if step.run_id != run_id:
                raise InvalidArgument(
                    f"step {step.event_id!r} belongs to run {step.run_id!r}, this service serves {run_id!r}"
                )
        except InvalidArgument as exc:
            rejected.append(_rejection(step, str(exc)))
            continue
        decoded.append(
            DecodedStep(
                step,
                np.array(step.prompt_token_ids, dtype=TOKEN_DTYPE),
                np.array(step.completion_token_ids, dtype=TOKEN_DTYPE),
                logprobs,
                np.array(step.completion_versions, dtype=VERSION_DTYPE),
                progress_from_pb(step.progress),
            )
        )
    return decoded, rejected


def shared_with_previous_call(
    tree: TaskTree,
    execution_id: str,
    call_seq: int,
    prompt: np.ndarray,
    previous_sequence: np.ndarray | None = None,
) -> tuple[Node, int] | None:
    """For a full prompt: (end node of the execution's previous call, tokens the prompt shares with it).

    Usually the prompt extends the previous call's sequence, so one vectorised comparison replaces
    the walk from the root that compares node by node (one numpy call per node of a deep path).
    The tree built is the same either way: the shared prefix is exactly the path to that node.
    ``previous_sequence``: that call's whole token sequence if the caller kept it (it is then not
    rebuilt from the tree's nodes).
    """
    prev = tree.calls.get((execution_id, call_seq - 1))
    if prev is None or not len(prompt):
        return None
    seq = tree.sequence(prev.end_node) if previous_sequence is None else previous_sequence
    m = min(len(seq), len(prompt))
    same = seq[:m] == prompt[:m]
    k = m if bool(same.all()) else int(np.argmin(same))
    return (prev.end_node, k) if k > 0 else None


class StepIngest:
    """Steps into trees and execution events into executions, over the shared state and the store."""

    def __init__(
        self,
        run_id: str,
        state: TrajectoryState,
        store: TrajectoryStore,
        commits: CommitQueue,
        scorer: Scorer,
        counters: Counter[str],
    ) -> None:
        self.run_id = run_id
        self.state = state
        self.store = store
        self.commits = commits
        self.scorer = scorer
        self.counters = counters
        # Execution id -> (its latest stored call, that call's whole token sequence), oldest first, at
        # most REMEMBERED_TOKENS tokens in all: the next full prompt is compared with it directly. An
        # entry is used only while it is the tree's own record of the previous call (a reload of the
        # state makes new records), so a stale or evicted entry only costs the rebuild from the tree.
        self._last_sequences: OrderedDict[str, tuple[CallRecord, np.ndarray]] = OrderedDict()
        self._remembered_tokens = 0
        # (execution_id, call_seq) -> deliveries a compact step has waited for its base call.
        self._waits: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.on_unresolved: Unresolved | None = None

    # ------------------------------------------------------------------ steps
    async def ingest_steps(self, steps: list[events_pb2.StepEvent]) -> trajectory_pb2.IngestSummary:
        """Store new steps once (committed before this returns); duplicates and invalid ones change no tree."""
        summary, committed = await self.insert_steps(steps)
        await committed
        return summary

    async def insert_steps(
        self, steps: list[events_pb2.StepEvent]
    ) -> tuple[trajectory_pb2.IngestSummary, asyncio.Future[None]]:
        """Insert new steps into the trees now and queue their commit; the returned future completes
        once they are committed (and counted), or raises if the commit failed (the state is then
        reloaded from Postgres). Calls insert in call order, so a caller may insert the next batch
        before this one is committed: commits are applied in the same order (CommitQueue)."""
        summary = trajectory_pb2.IngestSummary(num_received=len(steps))
        decoded, rejected = await asyncio.to_thread(decode_steps, steps, self.run_id)
        unresolved: list[tuple[events_pb2.StepEvent, str]] = []
        async with self.commits.lock:
            batch = self._insert(decoded, rejected, summary, unresolved)
            gen, fut = self.commits.submit(self.store.commit_steps, batch)
        if unresolved:
            self.counters["steps_unresolved"] += len(unresolved)
            if self.on_unresolved is not None:
                for step, reason in unresolved:
                    await self.on_unresolved(step, reason)

        async def committed() -> None:
            await self.commits.wait(gen, fut, lock_held=False)
            self.counters["steps_received"] += summary.num_received
            self.counters["steps_stored"] += summary.num_stored
            self.counters["steps_duplicate"] += summary.num_duplicates
            self.counters["steps_rejected"] += summary.num_rejected
            self.counters["steps_waiting_for_base"] += summary.num_waiting

        return summary, asyncio.ensure_future(committed())

    def _reject(self, summary: trajectory_pb2.IngestSummary, batch: StepBatch, r: Rejection) -> None:
        summary.num_rejected += 1
        summary.errors.append(r[2])
        batch.rejections.append(r)

    def _insert(
        self,
        decoded: list[DecodedStep],
        rejected: list[Rejection],
        summary: trajectory_pb2.IngestSummary,
        unresolved: list[tuple[events_pb2.StepEvent, str]],
    ) -> StepBatch:
        """Match each step against its task's tree and insert it (memory only; lock held, no await).
        Compact steps whose reference cannot be resolved are rejected and added to `unresolved`."""
        st = self.state
        batch = StepBatch()
        for r in rejected:
            self._reject(summary, batch, r)
        for d in decoded:
            step = d.step
            known = st.executions.get(step.execution_id)
            if known is not None and (known.group_id, known.task_id) != (step.group_id, step.task_id):
                self._reject(
                    summary,
                    batch,
                    _rejection(
                        step,
                        f"step {step.execution_id}.{step.call_seq}: execution belongs to group {known.group_id!r} of task "
                        f"{known.task_id!r}, not {step.group_id!r}/{step.task_id!r}",
                    ),
                )
                continue
            tree = st.trees.get(step.task_id)
            if tree is None:
                tree = st.trees[step.task_id] = TaskTree(step.task_id, st.ids)
                batch.tasks.add(step.task_id)
            if (step.execution_id, step.call_seq) in tree.calls:
                summary.num_duplicates += 1
                continue
            prompt = d.prompt
            if step.HasField("prompt_base_call_seq"):
                key = (step.execution_id, step.call_seq)
                base = tree.calls.get((step.execution_id, step.prompt_base_call_seq))
                problem = reference_problem(step, None if base is None else base.total_len)
                if base is None and 0 <= step.prompt_base_call_seq < step.call_seq:
                    waits = self._waits[key] = self._waits.get(key, 0) + 1
                    self._waits.move_to_end(key)
                    while len(self._waits) > 100_000:
                        self._waits.popitem(last=False)
                    if waits < BASE_WAIT_LIMIT:
                        summary.num_waiting += 1
                        continue
                    problem = f"{problem} after {waits} deliveries: the reference cannot be resolved"
                if base is not None and problem is None:
                    # The prompt is never rebuilt: its CRC continues the base path's kept CRC.
                    crc = token_crc32(prompt, prefix_crc32(base.end_node, step.prompt_base_len))
                    problem = prompt_sum_problem(step, step.prompt_base_len + len(prompt), crc)
                if problem is not None:
                    self._waits.pop(key, None)
                    self._reject(summary, batch, _rejection(step, problem))
                    unresolved.append((step, problem))
                    continue
                self._waits.pop(key, None)
                assert base is not None
                rec, changes = tree.insert_call_after(
                    step.execution_id,
                    step.call_seq,
                    base.end_node,
                    step.prompt_base_len,
                    prompt,
                    d.completion,
                    d.logprobs,
                    d.versions,
                    step.agent_id or "main",
                )
                self._forget(step.execution_id)  # its full sequence is not kept: never needed again
            else:
                last = self._last_sequences.get(step.execution_id)
                previous = tree.calls.get((step.execution_id, step.call_seq - 1))
                known_prefix = shared_with_previous_call(
                    tree,
                    step.execution_id,
                    step.call_seq,
                    prompt,
                    last[1] if last is not None and previous is not None and last[0] is previous else None,
                )
                rec, changes = tree.insert_call(
                    step.execution_id,
                    step.call_seq,
                    prompt,
                    d.completion,
                    d.logprobs,
                    d.versions,
                    step.agent_id or "main",
                    known_prefix,
                )
                if rec is not None:
                    self._remember(rec, prompt, d.completion)
            if rec is None:  # a duplicate the tree found itself
                summary.num_duplicates += 1
                continue
            for n in changes.created:
                batch.nodes[n.node_id] = (step.task_id, n)
                batch.created.add(n.node_id)
            for n in changes.modified:
                batch.nodes[n.node_id] = (step.task_id, n)
            batch.calls.append(
                NewCall(
                    step.task_id,
                    step.group_id,
                    rec,
                    progress_to_json(d.progress),
                    step.context_event,
                    step.num_migrations,
                )
            )
            info = st.executions.get(step.execution_id)
            if info is None:
                info = st.executions[step.execution_id] = ExecInfo(step.group_id, step.task_id)
                batch.executions[step.execution_id] = (step.group_id, step.task_id)
                batch.groups[step.group_id] = step.task_id
                batch.tasks.add(step.task_id)
                st.group(step.group_id, step.task_id).members.add(step.execution_id)
            info.step_progress[step.call_seq] = d.progress
            if info.last_step_progress is None or step.call_seq > info.last_step_progress[0]:
                info.last_step_progress = (step.call_seq, d.progress)
            summary.num_stored += 1
        return batch

    def _forget(self, execution_id: str) -> None:
        last = self._last_sequences.pop(execution_id, None)
        if last is not None:
            self._remembered_tokens -= len(last[1])

    def _remember(self, rec: CallRecord, prompt: np.ndarray, completion: np.ndarray) -> None:
        """Keep `rec`'s whole sequence as its execution's latest, if it is the latest call seen."""
        last = self._last_sequences.pop(rec.execution_id, None)
        if last is not None:
            self._remembered_tokens -= len(last[1])
            if last[0].call_seq > rec.call_seq:  # an older call arriving late: keep the newer one
                rec, seq = last
            else:
                seq = np.concatenate([prompt, completion])
        else:
            seq = np.concatenate([prompt, completion])
        self._last_sequences[rec.execution_id] = (rec, seq)
        self._remembered_tokens += len(seq)
        while self._remembered_tokens > REMEMBERED_TOKENS and len(self._last_sequences) > 1:
            _, (_, old) = self._last_sequences.popitem(last=False)
            self._remembered_tokens -= len(old)

    # ------------------------------------------------------------------ executions
    async def ingest_executions(self, events: list[events_pb2.ExecutionEvent]) -> int:
        """Record execution lifecycle events; invalid ones (NaN reward...) are kept as rejections. Returns #rejected."""
        rows: list[dict[str, Any]] = []
        rejections: list[Rejection] = []
        st = self.state
        async with self.commits.lock:
            for ev in events:
                try:
                    row = self._execution_row(ev)
                except InvalidArgument as exc:
                    log.warning("rejected execution event %s: %s", ev.event_id, exc)
                    rejections.append(
                        ("execution", ev.event_id or ev.execution_id, str(exc), ev.SerializeToString())
                    )
                    continue
                rows.append(row)
            await self.commits.commit(self.store.commit_executions, rows, rejections)
            for row in rows:
                info = st.executions.get(row["execution_id"])
                if info is None:
                    info = st.executions[row["execution_id"]] = ExecInfo(row["group_id"], row["task_id"])
                st.group(row["group_id"], row["task_id"]).members.add(row["execution_id"])
                if row["ending"] != "running" and info.ending is Ending.RUNNING:
                    info.ending = Ending(row["ending"])
                    info.reward, info.num_calls = row["reward"], row["num_calls"]
                    info.progress, info.ended_unix_s = (
                        progress_from_json(row["progress"]),
                        row["ended_unix_s"],
                    )
                    st.first_end[row["group_id"]] = min(
                        st.first_end.get(row["group_id"], math.inf), row["ended_unix_s"]
                    )
        self.counters["execution_events"] += len(events)
        self.counters["execution_events_rejected"] += len(rejections)
        return len(rejections)

    def _execution_row(self, ev: events_pb2.ExecutionEvent) -> dict[str, Any]:
        for name in ("task_id", "group_id", "execution_id"):
            if not getattr(ev, name):
                raise InvalidArgument(f"execution event {ev.event_id!r}: {name} is empty")
        if ev.run_id != self.run_id:
            raise InvalidArgument(
                f"execution event {ev.event_id!r} belongs to run {ev.run_id!r}, not {self.run_id!r}"
            )
        ending = _ENDINGS.get(ev.kind, Ending.RUNNING)
        progress = progress_from_pb(ev.progress)
        reward = ev.reward if ev.HasField("reward") else None
        if ending is not Ending.RUNNING:
            # Validate now, with the scorer's own rules, so a bad reward is refused at the door.
            self.scorer.score(Outcome(ev.execution_id, ending, reward, progress))
        return {
            "execution_id": ev.execution_id,
            "group_id": ev.group_id,
            "task_id": ev.task_id,
            "ending": ending.value,
            "reward": reward,
            "progress": progress_to_json(progress),
            "num_calls": ev.num_calls if ending is not Ending.RUNNING else None,
            "environment": ev.environment,
            "error": ev.error,
            "ended_unix_s": (ev.created_unix_s or time.time()) if ending is not Ending.RUNNING else None,
        }
