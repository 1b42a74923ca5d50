"""Request bodies of the OpenAI-compatible endpoint (pydantic models) and its HTTP error type.

Unknown fields (other clients' extensions) are ignored; known ones are typed, so a wrong type is
a 400 naming the field, never a 500.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from gyre.errors import InvalidArgument

ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
MAX_SEED = 2**63 - 1
MAX_N = 16
"""Most samples one request may ask for (`n`)."""


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body: {"error": {"message", "type", "code"}}."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "authentication_error")


def forbidden(message: str) -> ApiError:
    return ApiError(403, message, "permission_error")


# -- request models ------------------------------------------------------------------------------
class _Body(BaseModel):
    """Base of request bodies: unknown fields (other clients' extensions) are ignored, known ones typed."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool | None = None


class SamplingBody(_Body):
    """Fields shared by both generation routes. Fields Gyre knows but does not honour are typed as
    `Any` here and refused by `refuse_unsupported` with a 400 naming them, never silently ignored."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # Positive values below 1e-6 underflow the engine's float32 sampling (NaN log-probs): refused.
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, ge=1e-6, le=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED - 64)
    stop: str | list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(None, max_length=8)
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=64)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    # known, not honoured (refused unless neutral): see UNSUPPORTED
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < 1e-6:
            raise ValueError("temperature must be 0 (greedy) or at least 1e-6")
        return value

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> list[str]:
        """The `stop` sequences as a list (empty when unset); each non-empty."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingBody):
    """`POST /v1/completions`: one prompt, a string or token ids (`[[ids]]` also accepted)."""

    prompt: str | list[StrictInt] | Annotated[list[list[StrictInt]], Field(min_length=1, max_length=1)]
    logprobs: StrictInt | StrictBool | None = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None


class FunctionCall(_Body):
    name: str
    arguments: str = ""


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionSpec(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatRequest(SamplingBody):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    logprobs: StrictBool | None = None
    top_logprobs: Any = None
    functions: Any = None
    function_call: Any = None


def _set(value: Any) -> bool:
    return value is not None


UNSUPPORTED: list[tuple[str, Callable[[Any], bool], str]] = [
    ("logit_bias", lambda v: bool(v), "logit biases are not applied"),
    ("presence_penalty", lambda v: _set(v) and v != 0, "penalties are not applied; send 0 or omit it"),
    ("frequency_penalty", lambda v: _set(v) and v != 0, "penalties are not applied; send 0 or omit it"),
    ("response_format", lambda v: _set(v) and v != {"type": "text"}, "no constrained decoding: only {'type': 'text'}"),
    ("modalities", lambda v: _set(v) and v != ["text"], "text only"),
    ("audio", _set, "text only"),
    ("prediction", _set, "predicted outputs are not supported"),
    ("echo", lambda v: bool(v), "the prompt is not echoed; its ids are in prompt_token_ids"),
    ("best_of", lambda v: _set(v) and v != 1, "use n (each sample is its own step)"),
    ("suffix", lambda v: bool(v), "no insertion (fill-in-the-middle)"),
    ("tool_choice", lambda v: _set(v) and v not in ("auto", "none"),
     "only 'auto' and 'none' are honoured (no forced or named tool calls)"),
    ("parallel_tool_calls", lambda v: v is False, "calls cannot be limited to one; omit it or send true"),
    ("top_logprobs", lambda v: _set(v) and v != 0, "only the sampled token's log-prob is returned"),
    ("functions", _set, "the legacy functions API is not supported: use tools"),
    ("function_call", _set, "the legacy functions API is not supported: use tool_choice"),
]  # fmt: skip
"""(field, is it set to something Gyre does not honour, why): each is refused with HTTP 400."""


def refuse_unsupported(body: SamplingBody) -> None:
    """InvalidArgument naming the first field whose value Gyre does not honour (see UNSUPPORTED)."""
    fields = type(body).model_fields
    for name, bad, why in UNSUPPORTED:
        if name in fields and bad(getattr(body, name)):
            raise InvalidArgument(f"unsupported request field {name!r}: {why}")
    if (
        isinstance(body, CompletionRequest)
        and isinstance(body.logprobs, int)
        and not isinstance(body.logprobs, bool)
    ):
        if body.logprobs > 1:
            raise InvalidArgument(
                "unsupported request field 'logprobs' > 1: only the sampled token's log-prob"
            )
    if isinstance(body, ChatRequest):
        for i, message in enumerate(body.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                if part.type != "text":
                    raise InvalidArgument(
                        f"unsupported request field 'messages[{i}].content[{j}].type' {part.type!r}: text parts only"
                    )


class EndRequest(_Body):
    """End of an execution reported by an external harness."""

    kind: Literal["finished", "truncated", "failed"] = "finished"
    reward: float | None = Field(None, allow_inf_nan=False)
    error: str = Field("", max_length=4096)


class IssueRequest(_Body):
    """`POST /gyre/executions`: open one execution and get its own base URL and key."""

    task_id: str = Field("openai", pattern=ID_PATTERN.pattern)
    group_id: str | None = Field(None, pattern=ID_PATTERN.pattern)
    execution_id: str | None = Field(None, pattern=ID_PATTERN.pattern)


B = TypeVar("B", bound=BaseModel)


def validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "invalid request: " + "; ".join(parts)
