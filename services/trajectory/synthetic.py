"""Synthetic branching agent executions (for the benchmark and tests; not a scheduler workload).

Each execution is an agent loop over a task prompt: every turn the policy generates an action and
the environment answers with an observation appended to the context. Histories branch the way
real agents make them branch: every ``compaction_every`` turns the agent asks for a summary and the
context restarts as task prompt + summary; a fraction of turns is retried (the first attempt is
rolled back and the same prompt is sent again); the first ``shared_early_turns`` turns are
identical across the members of a group. Some executions are exact copies of a group mate
(exact duplicates) and some copy a group mate except for their last turns (near duplicates).
Token ids are random: only the structure matters here.

`LongConfig` / `long_executions` make the other shape, executions that run until their context
reaches a target (100K to 1M tokens, `gyre bench xlong`): stripped reasoning on every turn, retries,
sub-agents and shared first turns, each call generated when it is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class WorkloadConfig:
    num_groups: int = 8
    group_size: int = 8
    task_prompt_tokens: int = 4096
    num_turns: int = 40
    generated_tokens: int = 300
    observation_tokens: int = 700
    compaction_every: int = 10
    summary_tokens: int = 500
    retry_fraction: float = 0.1
    shared_early_turns: int = 2
    exact_duplicates_per_group: int = 1
    near_duplicates_per_group: int = 1
    near_duplicate_tail_turns: int = 3
    vocab: int = 500
    seed: int = 0


@dataclass(slots=True)
class GeneratedCall:
    task_id: str
    group_id: str
    execution_id: str
    call_seq: int
    prompt: np.ndarray
    completion: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    context_event: str = ""
    agent_id: str = "main"


@dataclass(slots=True)
class GeneratedExecution:
    task_id: str
    group_id: str
    execution_id: str
    calls: list[GeneratedCall] = field(default_factory=list)
    reward: float = 0.0
    finished: bool = True
    milestones_reached: int = 0
    milestones_total: int = 4


def _jitter(rng: np.random.Generator, n: int) -> int:
    return max(1, int(rng.integers(int(n * 0.8), int(n * 1.2) + 1)))


def _agent(
    cfg: WorkloadConfig,
    task_id: str,
    group_id: str,
    eid: str,
    task: np.ndarray,
    rng: np.random.Generator,
    shared: np.random.Generator,
    copy_of: GeneratedExecution | None = None,
    copy_turns: int = 0,
) -> GeneratedExecution:
    ex = GeneratedExecution(task_id, group_id, eid)
    ctx = task.copy()
    seq = 0

    def call(prompt: np.ndarray, gen: np.random.Generator, n: int, event: str = "") -> np.ndarray:
        nonlocal seq
        comp = gen.integers(0, cfg.vocab, _jitter(gen, n), dtype=np.int32)
        lp = (-gen.random(len(comp))).astype(np.float32)
        ex.calls.append(
            GeneratedCall(task_id, group_id, eid, seq, prompt, comp, lp, np.zeros(len(comp), np.int64), event)
        )
        seq += 1
        return comp

    for turn in range(cfg.num_turns):
        if copy_of is not None and turn < copy_turns:
            continue
        gen = shared if turn < cfg.shared_early_turns else rng
        if turn > 0 and turn % cfg.compaction_every == 0:
            summary = call(ctx, gen, cfg.summary_tokens)
            ctx = np.concatenate([task, summary])
            event = "compaction"
        else:
            event = ""
        if turn >= cfg.shared_early_turns and rng.random() < cfg.retry_fraction:
            call(ctx, rng, cfg.generated_tokens, event)  # rolled back
            event = "retry"
        action = call(ctx, gen, cfg.generated_tokens, event)
        obs = gen.integers(0, cfg.vocab, _jitter(gen, cfg.observation_tokens), dtype=np.int32)
        ctx = np.concatenate([ctx, action, obs])
    ex.finished = bool(rng.random() < 0.75)
    ex.reward = float(rng.random())
    ex.milestones_reached = int(rng.integers(0, ex.milestones_total + 1))
    return ex


def generate(cfg: WorkloadConfig) -> list[GeneratedExecution]:
    """Every execution of every group, calls in call_seq order."""
    rng = np.random.default_rng(cfg.seed)
    out: list[GeneratedExecution] = []
    for g in range(cfg.num_groups):
        task_id, group_id = f"t{g:04d}", f"t{g:04d}-g0"
        task = rng.integers(0, cfg.vocab, cfg.task_prompt_tokens, dtype=np.int32)
        shared_seed = int(rng.integers(1 << 31))
        members: list[GeneratedExecution] = []
        num_fresh = cfg.group_size - cfg.exact_duplicates_per_group - cfg.near_duplicates_per_group
        for i in range(cfg.group_size):
            eid = f"{group_id}-e{i}"
            shared = np.random.default_rng(shared_seed)
            if i < num_fresh or not members:
                ex = _agent(
                    cfg, task_id, group_id, eid, task, np.random.default_rng(rng.integers(1 << 31)), shared
                )
            elif i < num_fresh + cfg.exact_duplicates_per_group:
                src = members[i % len(members)]
                ex = GeneratedExecution(task_id, group_id, eid, reward=src.reward, finished=src.finished)
                ex.calls = [
                    GeneratedCall(
                        task_id,
                        group_id,
                        eid,
                        c.call_seq,
                        c.prompt,
                        c.completion,
                        c.logprobs,
                        c.versions,
                        c.context_event,
                    )
                    for c in src.calls
                ]
            else:
                src = members[i % len(members)]
                keep_turn = cfg.num_turns - cfg.near_duplicate_tail_turns
                # Copy the source's calls up to keep_turn, then continue with fresh tokens.
                ex = GeneratedExecution(task_id, group_id, eid, reward=float(rng.random()))
                tail = _near_duplicate_tail(
                    cfg, src, keep_turn, eid, np.random.default_rng(rng.integers(1 << 31))
                )
                ex.calls = tail
            members.append(ex)
        out.extend(members)
    return out


def _near_duplicate_tail(
    cfg: WorkloadConfig,
    src: GeneratedExecution,
    keep_calls_until_turn: int,
    eid: str,
    rng: np.random.Generator,
) -> list[GeneratedCall]:
    """The source's calls, except that the last calls get fresh completions (same prompts)."""
    n_keep = max(1, int(len(src.calls) * keep_calls_until_turn / max(cfg.num_turns, 1)))
    calls: list[GeneratedCall] = []
    for c in src.calls:
        comp = (
            c.completion
            if c.call_seq < n_keep
            else rng.integers(0, cfg.vocab, len(c.completion), dtype=np.int32)
        )
        calls.append(
            GeneratedCall(
                c.task_id,
                c.group_id,
                eid,
                c.call_seq,
                c.prompt,
                comp,
                c.logprobs,
                c.versions,
                c.context_event,
            )
        )
    return calls


def interleaved_tokens(calls: list[GeneratedCall]) -> int:
    """Tokens if calls are merged while the history extends as a prefix, a new sample at each break."""
    total = 0
    prev: np.ndarray | None = None
    for c in sorted(calls, key=lambda c: c.call_seq):
        full = np.concatenate([c.prompt, c.completion])
        if prev is not None and len(c.prompt) >= len(prev) and np.array_equal(c.prompt[: len(prev)], prev):
            total += len(full) - len(prev)
        else:
            total += len(full)
        prev = full
    return total


def xlong_execution(num_calls: int = 300, total_tokens: int = 700_000, seed: int = 1) -> list[GeneratedCall]:
    """One execution of ``num_calls`` calls whose distinct tokens add up to about ``total_tokens``."""
    rng = np.random.default_rng(seed)
    per_call = total_tokens // num_calls
    task = rng.integers(0, 500, 4096, dtype=np.int32)
    ctx = task
    calls: list[GeneratedCall] = []
    for s in range(num_calls):
        comp = rng.integers(0, 500, per_call // 3, dtype=np.int32)
        calls.append(
            GeneratedCall(
                "tx",
                "tx-g0",
                "tx-g0-e0",
                s,
                ctx,
                comp,
                (-rng.random(len(comp))).astype(np.float32),
                np.zeros(len(comp), np.int64),
            )
        )
        obs = rng.integers(0, 500, per_call - len(comp), dtype=np.int32)
        ctx = np.concatenate([task, comp[:200]]) if s % 30 == 29 else np.concatenate([ctx, comp, obs])
    return calls


def step_event(run_id: str, c: GeneratedCall) -> Any:
    """The StepEvent the rollout service would publish for this call."""
    from gyre.v1 import events_pb2

    return events_pb2.StepEvent(
        event_id=f"{c.execution_id}.{c.call_seq}",
        run_id=run_id,
        task_id=c.task_id,
        group_id=c.group_id,
        execution_id=c.execution_id,
        call_seq=c.call_seq,
        prompt_token_ids=c.prompt.tolist(),
        completion_token_ids=c.completion.tolist(),
        completion_logprobs=c.logprobs.tolist(),
        completion_versions=c.versions.tolist(),
        agent_id=c.agent_id,
        context_event=c.context_event,
    )


def end_event(run_id: str, ex: GeneratedExecution, reward: float | None = None) -> Any:
    """FINISHED (with the reward) or TRUNCATED (with milestones) event of a generated execution."""
    from gyre.v1 import common_pb2, events_pb2

    kind = (
        events_pb2.ExecutionEvent.KIND_FINISHED if ex.finished else events_pb2.ExecutionEvent.KIND_TRUNCATED
    )
    ev = events_pb2.ExecutionEvent(
        event_id=f"end.{ex.execution_id}",
        run_id=run_id,
        task_id=ex.task_id,
        group_id=ex.group_id,
        execution_id=ex.execution_id,
        kind=kind,
        num_calls=len(ex.calls),
        progress=common_pb2.ProgressSignal(
            milestones_reached=ex.milestones_reached, milestones_total=ex.milestones_total
        ),
    )
    if ex.finished:
        ev.reward = ex.reward if reward is None else reward
    return ev


def compact_step_events(run_id: str, calls: list[GeneratedCall]) -> list[Any]:
    """StepEvents of one execution as rollout publishes them (gyre.bus.steps.StepCompactor): each names
    the previous call as its base and carries only the tokens after the longest common prefix with
    that call's sequence, plus the full prompt's length and CRC-32."""
    from gyre.bus.steps import StepCompactor

    compactor = StepCompactor()
    return [compactor.compact(step_event(run_id, c)) for c in sorted(calls, key=lambda c: c.call_seq)]


# ------------------------------------------------------------------ long executions (gyre bench xlong)
@dataclass(slots=True)
class LongConfig:
    """Executions that run until their context reaches `context_tokens` (gyre bench xlong).

    Each turn the main agent reasons and answers (one call: completion = reasoning + answer); the next
    prompt keeps the answer and the environment's observation but strips the reasoning, so every call
    branches the tree (a leaf with the reasoning, the history going on). A fraction of turns is
    retried (the first attempt rolled back, the same prompt sent again); every `subagent_every` turns
    a sub-agent runs `subagent_calls` calls in its own context (task prompt + an instruction, growing
    with its own turns) and its result is the main agent's next observation; the first
    `shared_early_turns` turns are identical across the members of a group. No compaction: the
    longest path of an execution is its whole context (about `context_tokens`)."""

    context_tokens: int = 100_000
    num_groups: int = 1
    group_size: int = 8
    task_prompt_tokens: int = 4096
    reasoning_tokens: int = 3000
    answer_tokens: int = 500
    observation_tokens: int = 3000
    retry_fraction: float = 0.05
    subagent_every: int = 25
    subagent_calls: int = 4
    subagent_instruction_tokens: int = 300
    subagent_answer_tokens: int = 300
    subagent_observation_tokens: int = 1000
    shared_early_turns: int = 2
    vocab: int = 500
    seed: int = 0


@dataclass(slots=True)
class LongExecution:
    """One generated long execution: ids, outcome, and its calls made on demand (`calls()`), so that
    a million-token execution never holds more than its context and one call at a time."""

    cfg: LongConfig
    group_index: int
    member: int
    task_id: str
    group_id: str
    execution_id: str
    reward: float
    finished: bool = True
    milestones_reached: int = 0
    milestones_total: int = 4

    def calls(self) -> Iterator[GeneratedCall]:
        return _long_calls(self)


def long_executions(cfg: LongConfig) -> list[LongExecution]:
    """Every execution of every group (their calls are generated when iterated, deterministically)."""
    out: list[LongExecution] = []
    for g in range(cfg.num_groups):
        task_id, group_id = f"x{g:04d}", f"x{g:04d}-g0"
        rng = np.random.default_rng([cfg.seed, g])
        for i in range(cfg.group_size):
            out.append(
                LongExecution(
                    cfg,
                    g,
                    i,
                    task_id,
                    group_id,
                    f"{group_id}-e{i}",
                    reward=float(rng.random()),
                    milestones_reached=int(rng.integers(0, 5)),
                )  # fmt: skip
            )
    return out


def _long_calls(ex: LongExecution) -> Iterator[GeneratedCall]:
    cfg = ex.cfg
    task = np.random.default_rng([cfg.seed, ex.group_index, 1 << 20]).integers(
        0, cfg.vocab, cfg.task_prompt_tokens, dtype=np.int32
    )
    shared = np.random.default_rng([cfg.seed, ex.group_index, 1 << 21])
    own = np.random.default_rng([cfg.seed, ex.group_index, ex.member])
    ctx = np.empty(
        cfg.context_tokens + 8 * (cfg.observation_tokens + cfg.answer_tokens) + len(task), np.int32
    )
    ctx[: len(task)] = task
    n = len(task)
    seq = 0

    def tokens(gen: np.random.Generator, size: int) -> np.ndarray:
        return gen.integers(0, cfg.vocab, _jitter(gen, size), dtype=np.int32)

    def call(
        prompt: np.ndarray, completion: np.ndarray, gen: np.random.Generator, event: str, agent: str
    ) -> GeneratedCall:
        nonlocal seq
        lp = (-gen.random(len(completion))).astype(np.float32)
        c = GeneratedCall(
            ex.task_id, ex.group_id, ex.execution_id, seq, prompt, completion, lp,
            np.zeros(len(completion), np.int64), event, agent,
        )  # fmt: skip
        seq += 1
        return c

    turn = 0
    event = ""
    while True:
        gen = shared if turn < cfg.shared_early_turns else own
        prompt = ctx[:n].copy()
        if turn >= cfg.shared_early_turns and own.random() < cfg.retry_fraction:
            yield call(prompt, tokens(own, cfg.reasoning_tokens + cfg.answer_tokens), own, event, "main")
            event = "retry"
        reasoning, answer = tokens(gen, cfg.reasoning_tokens), tokens(gen, cfg.answer_tokens)
        yield call(prompt, np.concatenate([reasoning, answer]), gen, event, "main")
        if n + len(answer) >= cfg.context_tokens:
            return
        turn += 1
        if cfg.subagent_every and turn % cfg.subagent_every == 0:
            sub = np.concatenate([task, tokens(gen, cfg.subagent_instruction_tokens)])
            for _ in range(cfg.subagent_calls):
                out = tokens(gen, cfg.subagent_answer_tokens)
                yield call(sub, out, gen, "subagent", f"sub{turn}")
                sub = np.concatenate([sub, out, tokens(gen, cfg.subagent_observation_tokens)])
            obs = out
        else:
            obs = tokens(gen, cfg.observation_tokens)
        room = min(len(answer) + len(obs), len(ctx) - n)
        ctx[n : n + room] = np.concatenate([answer, obs])[:room]
        n += room
        event = "strip_reasoning"


def long_end_event(run_id: str, ex: LongExecution, num_calls: int) -> Any:
    """FINISHED event (with the reward) of a generated long execution of `num_calls` calls."""
    from gyre.v1 import common_pb2, events_pb2

    return events_pb2.ExecutionEvent(
        event_id=f"end.{ex.execution_id}",
        run_id=run_id,
        task_id=ex.task_id,
        group_id=ex.group_id,
        execution_id=ex.execution_id,
        kind=events_pb2.ExecutionEvent.KIND_FINISHED,
        num_calls=num_calls,
        reward=ex.reward,
        progress=common_pb2.ProgressSignal(
            milestones_reached=ex.milestones_reached, milestones_total=ex.milestones_total
        ),
    )
