"""The engine interface (token ids in; token ids, log-probs and per-token versions out) and its values.

An engine serves generation requests on one device. The contract the router relies on:

- `generate` returns one `Completion`; `finish_reason` is "stop" (a stop token, included),
  "length" (max_tokens reached) or "cut" (the engine was drained mid-generation: the tokens so
  far are exact and the caller resumes elsewhere with them appended to the prompt).
- Sampling is a pure function of (logits, sampling params, seed, absolute token index), so a
  generation resumed on another engine with `token_offset = tokens so far` continues exactly as
  it would have (bit-for-bit with greedy decoding; with temperature > 0 as long as the logits agree).
- `load_weights` switches at a safe point (between decode steps) and never aborts a generation;
  each token records the version that produced it.
- `drain` stops admitting requests, cuts every in-flight one at its current token and returns
  once all of them have been answered; the engine may then be closed.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field, replace

from gyre.errors import InvalidArgument, Unavailable
from gyre.tokenizer import EOS
from gyre.v1 import common_pb2


class EngineState(enum.StrEnum):
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters. temperature 0 = greedy; top_p in (0, 1] (1 = off)."""

    temperature: float = 0.0
    max_tokens: int = 64
    seed: int = 0
    stop_token_ids: tuple[int, ...] = (EOS,)
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise InvalidArgument(f"max_tokens must be > 0, got {self.max_tokens}")
        if not self.temperature >= 0 or not 0 < self.top_p <= 1:  # also rejects NaN
            raise InvalidArgument(
                f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}"
            )


@dataclass(frozen=True)
class GenerationRequest:
    """One call. `token_offset` = tokens of this completion already generated (and appended to
    `prompt_ids`) before a migration; sampling of token i uses absolute index token_offset + i."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    token_offset: int = 0
    execution_id: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise InvalidArgument(f"request {self.request_id!r}: prompt_ids must not be empty")

    def resumed(self, generated: list[int]) -> GenerationRequest:
        """The request that continues after `generated` tokens of this one."""
        return replace(
            self,
            prompt_ids=[*self.prompt_ids, *generated],
            sampling=replace(self.sampling, max_tokens=self.sampling.max_tokens - len(generated)),
            token_offset=self.token_offset + len(generated),
        )


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    engine_ids: list[str] = field(default_factory=list)
    num_migrations: int = 0
    # Tokens prefilled again on other engines because of migrations (prompt + generated so far).
    num_reprefilled_tokens: int = 0

    def extend(self, part: Completion) -> None:
        self.token_ids += part.token_ids
        self.logprobs += part.logprobs
        self.versions += part.versions
        self.finish_reason = part.finish_reason
        self.engine_ids += [e for e in part.engine_ids if not self.engine_ids or e != self.engine_ids[-1]]


class EngineFailed(Unavailable):
    """The engine died (its loop raised) while it held a request, or before the request came in.

    `partial` is what the engine had generated for the request (exact tokens, log-probs, versions,
    finish_reason "cut"): the router resumes it on another engine from there, as a migration."""

    def __init__(self, message: str, partial: Completion) -> None:
        super().__init__(message)
        self.partial = partial


class Engine(abc.ABC):
    """An inference engine on one device."""

    engine_id: str
    device_id: str

    @property
    @abc.abstractmethod
    def state(self) -> EngineState: ...

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the weights the engine generates with now."""

    @property
    @abc.abstractmethod
    def num_active(self) -> int:
        """Requests admitted or waiting on this engine."""

    @property
    def num_generating(self) -> int:
        """Requests the engine is decoding now (admitted to its batch, not waiting in its queue);
        an engine that cannot tell reports every active request."""
        return self.num_active

    @property
    def context_tokens(self) -> int:
        """Tokens of context (prompt plus tokens generated so far) held by the requests the engine
        is decoding now; 0 when the engine cannot tell."""
        return 0

    @property
    def busy_s(self) -> float:
        """Seconds this engine has held at least one request in its decode batch since it started
        (monotone; the device's busy time, which the scheduler's Elastic policy and the report
        read); 0 when the engine cannot tell."""
        return 0.0

    @property
    def tokens_generated(self) -> int:
        return 0

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> Completion: ...

    @abc.abstractmethod
    async def load_weights(self, weights: common_pb2.WeightVersion) -> None:
        """Switch to `weights` at the next safe point; returns once generating with it."""

    @abc.abstractmethod
    async def drain(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...
