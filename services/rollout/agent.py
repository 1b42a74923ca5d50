"""The agent loop of one execution, with context management.

    reset env -> ExecutionEvent STARTED
    loop: build prompt from history (context policy) -> router.generate -> env.step(action)
          -> StepEvent (full prompt ids, completion ids/logprobs/versions, progress, migrations)
          -> append the assistant turn (its exact tokens) and the env's reply to the history
    until done (FINISHED, final reward) | truncated or out of calls/context (TRUNCATED) | crash (FAILED)

History is kept as token ids per message (the run's tokenizer frames each one under its chat
template: `Tokenizer.message_ids`, `Tokenizer.framing`), so the next prompt contains the model's completion
exactly as generated (no re-tokenisation). Context policies decide what the next prompt shows:

- `none`: everything; each prompt extends the previous prompt + completion.
- `compaction`: every `compact_every` calls, all turns but the last `keep_last_turns` are replaced
  by one summary message (the opening messages stay); the next prompt is not an extension.
- `strip_reasoning`: earlier assistant turns are shown without their `<think>...</think>` span
  (the tokenizer's reasoning markers; a template without single-token markers strips nothing).

A call whose prompt does not extend the previous prompt + completion carries `context_event` =
the policy's name (informational: the trajectory service finds branches from the tokens).

Resuming (services/rollout/resume.py): `run(spec, env, resume_from=steps)` takes the stored calls
0..n-1 of an execution a killed predecessor left running. It publishes no STARTED (the execution
manager has published RESUMED) and runs the same loop, but for call k < n it takes the stored completion instead of generating and
hands it to `env.replay`; before that it checks that the prompt it rebuilt equals stored call k's
prompt token for token (else `ResumeDiverged`: the execution ends FAILED, "could not resume").
From call n on it generates as usual, so the calls it publishes continue the stored ones exactly.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from gyre import tokenizer as tok
from gyre.tokenizers import Tokenizer, load_tokenizer
from gyre.v1 import events_pb2

from .engines.base import Completion, GenerationRequest, Sampling
from .environments.base import Action, Environment, Progress, StepResult
from .steps import StepSink

log = logging.getLogger(__name__)

ContextPolicy = Literal["none", "compaction", "strip_reasoning"]


class ResumeDiverged(RuntimeError):
    """Replaying an execution's stored actions did not rebuild its stored prompts: it cannot resume."""


class Generator(Protocol):
    async def generate(self, request: GenerationRequest) -> Completion: ...


@dataclass(frozen=True)
class AgentConfig:
    temperature: float = 1.0
    max_tokens: int = 64
    max_calls: int = 1000
    max_context_tokens: int = 4096
    context: ContextPolicy = "none"
    compact_every: int = 8
    keep_last_turns: int = 2
    stop_token_ids: tuple[int, ...] = (tok.EOS,)


@dataclass(frozen=True)
class ExecutionSpec:
    run_id: str
    task_id: str
    group_id: str
    execution_id: str
    environment: str
    seed: int = 0
    agent_id: str = "main"


@dataclass
class _Entry:
    ids: list[int]
    shown_ids: list[int]  # what prompts show after the turn is over (reasoning stripped or not)
    opening: bool = False


@dataclass
class ExecutionOutcome:
    kind: int
    num_calls: int
    progress: Progress
    reward: float | None = None
    error: str = ""
    num_migrations: int = 0
    tokens_generated: int = 0
    completions: list[list[int]] = field(default_factory=list)
    resumed_calls: int = 0  # calls replayed from the stored steps (0: not a resumed execution)


def call_seed(seed: int, execution_id: str, call_seq: int) -> int:
    """Sampling seed of one call: stable across processes, engines and migrations."""
    digest = hashlib.blake2b(f"{seed}/{execution_id}/{call_seq}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def strip_reasoning(ids: list[int]) -> list[int]:
    """`ids` without their byte-template `<think>...</think>` spans."""
    return load_tokenizer("byte").framing().strip_reasoning(ids)


class Conversation:
    """Message token ids of one execution plus the context policy that turns them into prompts."""

    def __init__(self, config: AgentConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer("byte")
        self.framing = self.tokenizer.framing()
        self.entries: list[_Entry] = []
        self.num_turns = 0
        self.compacted_turns = 0

    def add_opening(self, messages: list[dict]) -> None:
        for m in messages:
            ids = self.tokenizer.message_ids(m)
            self.entries.append(_Entry(ids, ids, opening=True))

    def add_turn(self, completion_ids: list[int], env_messages: list[dict]) -> None:
        ids = self.framing.assistant_turn(completion_ids, self.config.stop_token_ids)
        shown = self.framing.strip_reasoning(ids) if self.config.context == "strip_reasoning" else ids
        self.entries.append(_Entry(ids, shown))
        for m in env_messages:
            mids = self.tokenizer.message_ids(m)
            self.entries.append(_Entry(mids, mids))
        self.num_turns += 1

    def maybe_compact(self, progress: Progress) -> bool:
        """Apply compaction if due; True if the history changed."""
        cfg = self.config
        if cfg.context != "compaction" or self.num_turns == 0 or self.num_turns % cfg.compact_every:
            return False
        opening = [e for e in self.entries if e.opening]
        rest = [e for e in self.entries if not e.opening]
        head = list(self.framing.generation_prompt_ids)
        starts = [i for i, e in enumerate(rest) if e.ids[: len(head)] == head]
        if len(starts) <= cfg.keep_last_turns:
            return False
        cut = starts[-cfg.keep_last_turns] if cfg.keep_last_turns else len(rest)
        self.compacted_turns += sum(1 for s in starts if s < cut)
        summary = (
            f"[summary] {self.compacted_turns} earlier turns compacted; "
            f"progress {progress.milestones_reached}/{progress.milestones_total}"
            + (
                f", tests {progress.tests_passed_fraction:.2f}"
                if progress.tests_passed_fraction is not None
                else ""
            )
        )
        sids = self.tokenizer.message_ids({"role": "user", "content": summary})
        self.entries = [*opening, _Entry(sids, sids, opening=True), *rest[cut:]]
        return True

    def prompt(self) -> list[int]:
        ids = list(self.framing.begin_ids)
        for e in self.entries:
            ids += e.shown_ids
        return ids + list(self.framing.generation_prompt_ids)


class Agent:
    """Runs executions: one environment, one conversation, calls through a Generator (the router)."""

    def __init__(
        self, generator: Generator, sink: StepSink, config: AgentConfig, tokenizer: Tokenizer | None = None
    ) -> None:
        """`tokenizer`: the run's (default: byte); `config.stop_token_ids` should be its stop ids."""
        self.generator, self.sink, self.config = generator, sink, config
        self.tokenizer = tokenizer or load_tokenizer("byte")

    def _execution_event(
        self,
        spec: ExecutionSpec,
        kind: int,
        progress: Progress,
        num_calls: int,
        reward: float | None = None,
        error: str = "",
    ) -> events_pb2.ExecutionEvent:
        name = events_pb2.ExecutionEvent.Kind.Name(kind).removeprefix("KIND_").lower()  # type: ignore[arg-type]
        ev = events_pb2.ExecutionEvent(
            event_id=f"{spec.execution_id}.{name}",
            run_id=spec.run_id,
            task_id=spec.task_id,
            group_id=spec.group_id,
            execution_id=spec.execution_id,
            kind=kind,  # type: ignore[arg-type]
            progress=progress.to_proto(),
            num_calls=num_calls,
            environment=spec.environment,
            error=error[:2000],
            created_unix_s=time.time(),
        )
        if reward is not None:
            ev.reward = reward
        return ev

    async def run(
        self,
        spec: ExecutionSpec,
        env: Environment,
        resume_from: Sequence[events_pb2.StepEvent] = (),
    ) -> ExecutionOutcome:
        """Run `spec` to its end; with `resume_from` (stored calls 0..n-1, full prompts) continue it
        after replaying them (module docstring). Never raises for a crash: that is a FAILED outcome."""
        cfg = self.config
        E = events_pb2.ExecutionEvent
        if not resume_from:
            await self.sink.publish_execution(self._execution_event(spec, E.KIND_STARTED, env.progress, 0))
        conv = Conversation(cfg, self.tokenizer)
        out = ExecutionOutcome(kind=E.KIND_TRUNCATED, num_calls=0, progress=env.progress)
        try:
            conv.add_opening(await env.reset())
            previous: list[int] = []
            result: StepResult | None = None
            for call_seq in range(cfg.max_calls):
                compacted = conv.maybe_compact(env.progress)
                prompt = conv.prompt()
                stored = resume_from[call_seq] if call_seq < len(resume_from) else None
                if stored is None and len(prompt) + cfg.max_tokens > cfg.max_context_tokens:
                    break  # out of context: truncated
                event = ""
                if previous and prompt[: len(previous)] != previous:
                    event = "compaction" if compacted else cfg.context
                if stored is not None:  # a call the predecessor made: replay it, publish nothing
                    completion = _replayed(stored, prompt)
                    result = await env.replay(Action.from_ids(completion.token_ids, self.tokenizer))
                    out.resumed_calls = call_seq + 1
                else:
                    completion, result, started = await self._call(spec, env, call_seq, prompt)
                    await self.sink.publish_step(
                        step_event(spec, call_seq, prompt, completion, result.progress, event, started)
                    )
                out.num_calls = call_seq + 1
                out.num_migrations += completion.num_migrations
                out.tokens_generated += len(completion.token_ids)
                out.completions.append(completion.token_ids)
                conv.add_turn(completion.token_ids, result.messages)
                previous = prompt + completion.token_ids
                if result.done:
                    out.kind, out.reward = E.KIND_FINISHED, result.reward
                    break
                if result.truncated:
                    break
            out.progress = env.progress
        except Exception as exc:  # the agent's one boundary: the execution fails, the service lives on
            log.exception("execution %s failed", spec.execution_id)
            reason = f"could not resume: {exc}" if isinstance(exc, ResumeDiverged) else repr(exc)
            out.kind, out.error, out.progress = E.KIND_FAILED, reason, env.progress
        finally:
            await env.close()
        await self.sink.publish_execution(
            self._execution_event(spec, out.kind, out.progress, out.num_calls, out.reward, out.error)
        )
        return out

    async def _call(
        self, spec: ExecutionSpec, env: Environment, call_seq: int, prompt: list[int]
    ) -> tuple[Completion, StepResult, float]:
        """One new LLM call and the environment's answer; returns them and when the call started."""
        cfg = self.config
        sampling = Sampling(
            temperature=cfg.temperature,
            max_tokens=cfg.max_tokens,
            seed=call_seed(spec.seed, spec.execution_id, call_seq),
            stop_token_ids=cfg.stop_token_ids,
        )
        started = time.time()
        completion = await self.generator.generate(
            GenerationRequest(
                f"{spec.execution_id}.{call_seq}", prompt, sampling, execution_id=spec.execution_id
            )
        )
        return completion, await env.step(Action.from_ids(completion.token_ids, self.tokenizer)), started


def _replayed(stored: events_pb2.StepEvent, prompt: list[int]) -> Completion:
    """The completion of a stored call, after checking that `prompt` (rebuilt by replay) is its prompt."""
    if list(stored.prompt_token_ids) != prompt:
        at = next(
            (i for i, (a, b) in enumerate(zip(prompt, stored.prompt_token_ids, strict=False)) if a != b), None
        )
        raise ResumeDiverged(
            f"replayed prompt of call {stored.call_seq} differs from the stored one "
            f"({len(prompt)} vs {len(stored.prompt_token_ids)} tokens, first difference at "
            f"{min(len(prompt), len(stored.prompt_token_ids)) if at is None else at})"
        )
    return Completion(
        token_ids=list(stored.completion_token_ids),
        logprobs=list(stored.completion_logprobs),
        versions=list(stored.completion_versions),
        engine_ids=list(stored.engine_ids),
        num_migrations=stored.num_migrations,
    )


def step_event(
    spec: ExecutionSpec,
    call_seq: int,
    prompt: list[int],
    completion: Completion,
    progress: Progress,
    context_event: str,
    started_unix_s: float,
) -> events_pb2.StepEvent:
    """The StepEvent of one LLM call (shared by the agent loop and the OpenAI endpoint)."""
    return events_pb2.StepEvent(
        event_id=f"{spec.execution_id}.{call_seq}",
        run_id=spec.run_id,
        task_id=spec.task_id,
        group_id=spec.group_id,
        execution_id=spec.execution_id,
        call_seq=call_seq,
        prompt_token_ids=prompt,
        completion_token_ids=completion.token_ids,
        completion_logprobs=completion.logprobs,
        completion_versions=completion.versions,
        progress=progress.to_proto(),
        agent_id=spec.agent_id,
        num_migrations=completion.num_migrations,
        engine_ids=completion.engine_ids,
        context_event=context_event,
        started_unix_s=started_unix_s,
        finished_unix_s=time.time(),
    )
