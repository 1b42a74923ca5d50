"""The OpenAI endpoint's state beside its registry: the router it generates through, the step sink
every call is published to, the body parser and the prompt bounds.

Every call goes through the router (migration-safe) and becomes one StepEvent whose prompt and
completion ids are exactly what the engine saw and produced; `call_seq` counts per execution in
this process. A body larger than `max_request_bytes` is refused (413) before it is parsed; a
prompt longer than `max_prompt_tokens` characters before it is tokenised.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from gyre.errors import InvalidArgument, PayloadTooLarge
from gyre.tokenizers import Tokenizer, load_tokenizer

from ..agent import call_seed, step_event
from ..engines.base import Completion, GenerationRequest, Sampling
from ..environments.base import Progress
from ..router import Router
from ..steps import StepSink
from .auth import ExecutionRegistry, ExecutionState
from .schema import SamplingBody, validation_message
from .stops import cut_at_stop

B = TypeVar("B", bound=BaseModel)


class OpenAIEndpoint(ExecutionRegistry):
    """State behind the routes: router, tokenizer, step sink, credentials, executions and owners.

    `tokenizer`: the run's tokenizer (default: the byte tokenizer); `vocab_size`: the model's
    embedding rows, bound of client-sent token ids (default: the tokenizer's). `max_prompt_tokens`:
    the model's context (positions): prompt + completion must fit; text prompts are bounded by
    characters before tokenising. `max_request_bytes`: body bound. The rest as `ExecutionRegistry`.
    """

    def __init__(
        self,
        router: Router,
        sink: StepSink,
        *,
        run_id: str,
        tokenizer: Tokenizer | None = None,
        vocab_size: int | None = None,
        model_name: str = "gyre",
        seed: int = 0,
        api_key: str | None = None,
        admin_key: str | None = None,
        max_prompt_tokens: int = 4096,
        max_request_bytes: int = 8 << 20,
        execution_idle_s: float = 3600.0,
        reap_interval_s: float = 5.0,
        public_url: str = "",
    ) -> None:
        super().__init__(
            sink, run_id=run_id, seed=seed, api_key=api_key, admin_key=admin_key,
            execution_idle_s=execution_idle_s, reap_interval_s=reap_interval_s, public_url=public_url,
        )  # fmt: skip
        self.router, self.model_name = router, model_name
        self.tokenizer = tokenizer or load_tokenizer("byte")
        self.vocab_size = vocab_size or self.tokenizer.vocab_size
        self.max_prompt_tokens, self.max_request_bytes = max_prompt_tokens, max_request_bytes

    def sampling(self, body: SamplingBody, state: ExecutionState, num_prompt_tokens: int) -> Sampling:
        """Engine sampling of one call; `max_tokens` defaults to the context left after the prompt."""
        left = self.max_prompt_tokens - num_prompt_tokens
        max_tokens = body.max_completion_tokens or body.max_tokens or left
        if max_tokens > left:
            raise InvalidArgument(
                f"max_tokens {max_tokens} does not fit: the prompt has {num_prompt_tokens} tokens and the "
                f"model {self.max_prompt_tokens} positions ({left} left)"
            )
        stop = body.stop_token_ids
        if stop is not None and any(not 0 <= t < self.vocab_size for t in stop):
            raise InvalidArgument(f"stop_token_ids must be in [0, {self.vocab_size})")
        return Sampling(
            temperature=1.0 if body.temperature is None else body.temperature,
            max_tokens=max_tokens,
            seed=body.seed
            if body.seed is not None
            else call_seed(self.seed, state.spec.execution_id, state.calls),
            stop_token_ids=tuple(stop) if stop is not None else self.tokenizer.stop_ids,
            top_p=1.0 if body.top_p is None else body.top_p,
        )

    def check_prompt_ids(self, prompt: list[int]) -> None:
        if not prompt:
            raise InvalidArgument("prompt must not be empty")
        if len(prompt) >= self.max_prompt_tokens:
            raise InvalidArgument(
                f"prompt has {len(prompt)} tokens; the model has {self.max_prompt_tokens} positions"
            )
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidArgument(f"prompt token ids must be in [0, {self.vocab_size})")

    def check_prompt_chars(self, num_chars: int) -> None:
        """Bound a text prompt before tokenising: no token covers more than `max_chars_per_token`."""
        bound = self.max_prompt_tokens * self.tokenizer.max_chars_per_token
        if num_chars > bound:
            raise InvalidArgument(
                f"prompt has {num_chars} characters, more than {self.max_prompt_tokens} tokens can hold"
            )

    async def samples(
        self, state: ExecutionState, prompt: list[int], body: SamplingBody
    ) -> list[tuple[Completion, str | None]]:
        """`body.n` samples of one prompt, each its own call (and step) with its own seed.

        Each is cut at the first `stop` string (text before it returned beside; None: no stop
        string met) before its step is published.
        """
        base = self.sampling(body, state, len(prompt))
        samplings = [base]
        for i in range(1, body.n):
            seed = (
                base.seed + i
                if body.seed is not None
                else call_seed(self.seed, state.spec.execution_id, state.calls + i)
            )
            samplings.append(replace(base, seed=seed))
        stops = body.stop_strings()
        return list(await asyncio.gather(*(self.call(state, prompt, s, stops) for s in samplings)))

    async def call(
        self, state: ExecutionState, prompt: list[int], sampling: Sampling, stops: list[str] | None = None
    ) -> tuple[Completion, str | None]:
        """One generation through the router, cut at `stops`, published as step `call_seq` of `state`."""
        seq = state.calls
        state.calls += 1
        state.last_call_s = time.monotonic()
        started = time.time()
        request = GenerationRequest(
            f"{state.spec.execution_id}.{seq}", prompt, sampling, execution_id=state.spec.execution_id
        )
        completion = await self.router.generate(request)
        completion, text = cut_at_stop(completion, self.tokenizer, stops or [])
        state.last_call_s = time.monotonic()
        await self.sink.publish_step(step_event(state.spec, seq, prompt, completion, Progress(), "", started))
        return completion, text

    async def parse(self, request: Request, model: type[B]) -> B:
        """The body of `request` as `model`: 413 beyond `max_request_bytes` (read in chunks), else 400."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            raise PayloadTooLarge(f"request body of {declared} bytes exceeds {self.max_request_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_request_bytes:
                raise PayloadTooLarge(f"request body exceeds {self.max_request_bytes} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            return model.model_validate_json(raw or b"{}")
        except ValidationError as exc:
            raise InvalidArgument(validation_message(exc)) from None
