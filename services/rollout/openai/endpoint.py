"""The OpenAI endpoint's state beside its registry: the router it generates through, the step sink
every call is published to, the body parser and the prompt bounds.

Every call goes through the router (migration-safe) and becomes one StepEvent whose prompt and
completion ids are exactly what the engine saw and produced; `call_seq` counts per execution in
this process. A body larger than `max_request_bytes` is refused (413) before it is parsed; a
prompt longer than `max_prompt_tokens` characters before it is tokenised.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from gyre import tokenizer as tok
from gyre.errors import Conflict, InvalidArgument, PayloadTooLarge
from gyre.v1 import common_pb2

from ..agent import call_seed, step_event
from ..engines.base import Completion, GenerationRequest, Sampling
from ..environments.base import Progress
from ..router import Router
from ..steps import StepSink
from .auth import ExecutionRegistry, ExecutionState
from .schema import SamplingBody, validation_message

B = TypeVar("B", bound=BaseModel)


class OpenAIEndpoint(ExecutionRegistry):
    """State behind the routes: router, step sink, credentials, executions and their owners.

    `max_prompt_tokens`: prompt bound (tokens; strings are bounded by characters before
    tokenising). `max_request_bytes`: body bound. The rest as `ExecutionRegistry`.
    """

    def __init__(
        self,
        router: Router,
        sink: StepSink,
        *,
        run_id: str,
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
        self.max_prompt_tokens, self.max_request_bytes = max_prompt_tokens, max_request_bytes
        self.sleeping = False
        self.weights_loader: Callable[[common_pb2.WeightVersion], Awaitable[None]] | None = None

    def sampling(self, body: SamplingBody, state: ExecutionState) -> Sampling:
        max_tokens = body.max_completion_tokens or body.max_tokens or 64
        if max_tokens > self.max_prompt_tokens:
            raise InvalidArgument(
                f"max_tokens {max_tokens} exceeds the model's {self.max_prompt_tokens} positions"
            )
        stop = body.stop_token_ids
        if stop is not None and any(not 0 <= t < tok.VOCAB_SIZE for t in stop):
            raise InvalidArgument(f"stop_token_ids must be in [0, {tok.VOCAB_SIZE})")
        return Sampling(
            temperature=1.0 if body.temperature is None else body.temperature,
            max_tokens=max_tokens,
            seed=body.seed
            if body.seed is not None
            else call_seed(self.seed, state.spec.execution_id, state.calls),
            stop_token_ids=tuple(stop) if stop is not None else (tok.EOS,),
            top_p=1.0 if body.top_p is None else body.top_p,
        )

    def check_prompt_ids(self, prompt: list[int]) -> None:
        if not prompt:
            raise InvalidArgument("prompt must not be empty")
        if len(prompt) > self.max_prompt_tokens:
            raise InvalidArgument(f"prompt has {len(prompt)} tokens; at most {self.max_prompt_tokens}")
        if any(not 0 <= t < tok.VOCAB_SIZE for t in prompt):
            raise InvalidArgument(f"prompt token ids must be in [0, {tok.VOCAB_SIZE})")

    def check_prompt_chars(self, num_chars: int) -> None:
        """Bound a text prompt before tokenising: every character is at least one byte token."""
        if num_chars > self.max_prompt_tokens:
            raise InvalidArgument(
                f"prompt has {num_chars} characters, more than the {self.max_prompt_tokens} tokens allowed"
            )

    async def call(self, state: ExecutionState, prompt: list[int], sampling: Sampling) -> Completion:
        if self.sleeping:
            raise Conflict("the engine is sleeping; POST /wake_up first")
        seq = state.calls
        state.calls += 1
        state.last_call_s = time.monotonic()
        started = time.time()
        request = GenerationRequest(
            f"{state.spec.execution_id}.{seq}", prompt, sampling, execution_id=state.spec.execution_id
        )
        completion = await self.router.generate(request)
        state.last_call_s = time.monotonic()
        await self.sink.publish_step(step_event(state.spec, seq, prompt, completion, Progress(), "", started))
        return completion

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
