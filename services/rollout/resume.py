"""Durable executions: what a restarted rollout reads to resume the executions its predecessor left running.

Where the state lives, and why there: on the bus, in the streams the rollout already writes. An
execution's per-turn state is

    its identity (task, group, execution id, environment)  -> the STARTED ExecutionEvent
    every call's prompt and completion as token ids,         -> one StepEvent per call, acked by
    policy versions, log-probs, progress and call_seq           JetStream before the sink forgets it
    the environment's state                                  -> the action log: the completions
                                                                 themselves, replayed into a fresh
                                                                 environment (`Environment.replay`)
    the agent's state (the conversation and its context      -> rebuilt by the same code that built
    policy's compactions)                                        it, from the replayed observations

So nothing is written twice: the step stream *is* the action log, and a turn is durable once its
StepEvent is stored. No Postgres read either: the trajectory store may lag the bus (its ingest is
batched) and is another service's data. A call whose StepEvent was not yet stored when the process
died is simply made again: its sampling seed is a function of (run seed, execution id, call_seq)
(agent.call_seed), so with unchanged weights it produces the same tokens.

Guarantees (read by `ResumePlan.load` and checked by `Agent.run` when it replays):

* the steps of an execution that are used are the contiguous prefix call_seq = 0..n-1 (one per
  call_seq, the first stored wins: a redelivered duplicate is identical by the event_id dedup);
  anything after a gap is not replayed, and the resumed execution's next call is call_seq = n;
* before replaying call k the agent rebuilds the prompt from the replayed history and compares it
  with stored step k's prompt, token for token. Any difference (an environment that answered the
  replayed action differently) ends the execution FAILED with "could not resume: ..." instead of
  continuing a conversation the stored tree does not contain. A resumed execution therefore adds
  to its tree exactly the nodes an uninterrupted one would have added: no duplicate, no gap.

Environments (services/rollout/environments/): `longhorizon` and `workload` are deterministic
functions of the task and the actions and resume by replay (workload skips its modelled tool waits
on replay); `workspace` resumes by replaying its tool calls into a fresh workspace (file writes are
exact; a `run` command whose output changes between runs makes the prompt check fail, so that
execution ends with the reason). The external harness (harness.py) cannot resume: its agent process
is the user's and its state is not ours to restore, so its executions end FAILED with that reason.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gyre.bus import subjects
from gyre.bus.steps import join_stored_parts, prompt_check, rebuild_prompt, reference_problem
from gyre.v1 import events_pb2

from .agent import ExecutionSpec
from .steps import StepSink

E = events_pb2.ExecutionEvent
# Kinds that end an execution (RESUMED and STARTED do not).
ENDED_KINDS = frozenset({E.KIND_FINISHED, E.KIND_TRUNCATED, E.KIND_FAILED})


@dataclass
class ResumePoint:
    """One execution a predecessor left running: its STARTED event and its stored calls 0..n-1."""

    started: events_pb2.ExecutionEvent
    steps: list[events_pb2.StepEvent] = field(default_factory=list)

    @property
    def execution_id(self) -> str:
        return self.started.execution_id

    def spec(self, seed: int) -> ExecutionSpec:
        s = self.started
        return ExecutionSpec(s.run_id, s.task_id, s.group_id, s.execution_id, s.environment, seed=seed)


def full_prompt(step: events_pb2.StepEvent, earlier: dict[int, events_pb2.StepEvent]) -> list[int] | None:
    """The exact prompt of `step`: its own ids, or for a compact step (prompt_base_call_seq set) the
    first prompt_base_len tokens of its base call's prompt + completion, then its ids (checked against
    the producer's length and CRC-32, gyre.bus.steps). None when the base call is not among `earlier`
    (already expanded steps of the same execution) or the rebuilt prompt fails its check."""
    if not step.HasField("prompt_base_call_seq"):
        return list(step.prompt_token_ids)
    base = earlier.get(step.prompt_base_call_seq)
    base_len = None if base is None else len(base.prompt_token_ids) + len(base.completion_token_ids)
    if base is None or reference_problem(step, base_len) is not None:
        return None
    sequence = np.concatenate(
        [
            np.asarray(base.prompt_token_ids, dtype=np.int32),
            np.asarray(base.completion_token_ids, dtype=np.int32),
        ]
    )
    prompt = rebuild_prompt(step, sequence)
    if prompt_check(step, prompt) is not None:
        return None
    return list(prompt.tolist())


def contiguous_calls(steps: Iterable[events_pb2.StepEvent]) -> list[events_pb2.StepEvent]:
    """Steps of one execution as calls 0..n-1 with full prompts: the first stored step per call_seq
    (a step split into parts joined; an incomplete one is missing), cut at the first missing call
    (or one whose compact prompt cannot be rebuilt)."""
    first: dict[int, events_pb2.StepEvent] = {}
    for st in join_stored_parts(list(steps)):
        first.setdefault(st.call_seq, st)
    out: dict[int, events_pb2.StepEvent] = {}
    for seq in range(len(first)):
        step = first.get(seq)
        if step is None:
            break
        prompt = full_prompt(step, out)
        if prompt is None:
            break
        expanded = events_pb2.StepEvent()
        expanded.CopyFrom(step)
        expanded.ClearField("prompt_base_call_seq")
        expanded.prompt_base_len = 0
        expanded.prompt_num_tokens, expanded.prompt_crc32 = 0, 0
        expanded.prompt_token_ids[:] = prompt
        out[seq] = expanded
    return [out[s] for s in range(len(out))]


@dataclass
class ResumePlan:
    """What a restarted rollout found on the bus: the executions without an end event, with their steps."""

    points: list[ResumePoint]

    @classmethod
    async def load(cls, bus: Any, run_id: str, *, idle_timeout_s: float = 5.0) -> ResumePlan:
        """Read the execution stream of `run_id` (STARTED without an end event, RESUMED ignored),
        then the step streams of those executions' tasks. Reads only (ordered ephemeral consumers):
        nobody's delivery state changes."""
        started: dict[str, events_pb2.ExecutionEvent] = {}
        ended: set[str] = set()
        async for stored in bus.replay(subjects.executions(run_id, "*"), idle_timeout_s=idle_timeout_s):
            ev = events_pb2.ExecutionEvent.FromString(stored.data)
            if ev.kind == E.KIND_STARTED:
                started.setdefault(ev.execution_id, ev)
            elif ev.kind in ENDED_KINDS:
                ended.add(ev.execution_id)
        live = {eid: ev for eid, ev in started.items() if eid not in ended}
        steps: dict[str, list[events_pb2.StepEvent]] = {eid: [] for eid in live}
        for task_id in sorted({ev.task_id for ev in live.values()}):
            async for stored in bus.replay(subjects.steps(run_id, task_id), idle_timeout_s=idle_timeout_s):
                st = events_pb2.StepEvent.FromString(stored.data)
                if st.execution_id in steps:
                    steps[st.execution_id].append(st)
        return cls([ResumePoint(ev, contiguous_calls(steps[eid])) for eid, ev in live.items()])


def resumed_event(point: ResumePoint, incarnation: int) -> events_pb2.ExecutionEvent:
    """The RESUMED event of `point` in the `incarnation`-th start of the rollout (dedup key per start)."""
    s = point.started
    return E(
        event_id=f"{s.execution_id}.resumed.{incarnation}",
        run_id=s.run_id,
        task_id=s.task_id,
        group_id=s.group_id,
        execution_id=s.execution_id,
        kind=E.KIND_RESUMED,
        num_calls=len(point.steps),
        environment=s.environment,
        progress=point.steps[-1].progress if point.steps else s.progress,
        created_unix_s=time.time(),
    )


async def end_unresumable(sink: StepSink, started: events_pb2.ExecutionEvent, reason: str) -> None:
    """End an execution a predecessor left running that this process does not resume: a FAILED event
    with `reason`, so the trajectory scores it as unfinished (partial progress). Idempotent: the
    event id `<execution_id>.orphaned` is deduplicated by JetStream."""
    await sink.publish_execution(
        E(
            event_id=f"{started.execution_id}.orphaned",
            run_id=started.run_id,
            task_id=started.task_id,
            group_id=started.group_id,
            execution_id=started.execution_id,
            kind=E.KIND_FAILED,
            environment=started.environment,
            error=reason,
            created_unix_s=time.time(),
        )
    )
