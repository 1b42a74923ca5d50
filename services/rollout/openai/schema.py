"""Request bodies of the OpenAI-compatible endpoint (pydantic models) and its HTTP error type.

Unknown fields (other clients' extensions) are ignored; known ones are typed, so a wrong type is
a 400 naming the field, never a 500.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
MAX_SEED = 2**63 - 1


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


class SamplingBody(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # Positive values below 1e-6 underflow the engine's float32 sampling (NaN log-probs): refused.
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, ge=1e-6, le=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=64)
    n: Literal[1] = 1
    stream: Literal[False] = False
    user: str | None = None
    metadata: dict[str, str] | None = None

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < 1e-6:
            raise ValueError("temperature must be 0 (greedy) or at least 1e-6")
        return value


class CompletionRequest(SamplingBody):
    """`POST /v1/completions`: one prompt, a string or token ids (`[[ids]]` also accepted)."""

    prompt: str | list[StrictInt] | Annotated[list[list[StrictInt]], Field(min_length=1, max_length=1)]
    logprobs: StrictInt | StrictBool | None = None


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
    logprobs: StrictBool | None = None


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


class CollectiveRpcKwargs(_Body):
    version: int = Field(ge=1)
    uri: str = Field(max_length=4096)
    sha256: str = ""


class CollectiveRpcRequest(_Body):
    method: Literal["reload_weights"]
    kwargs: CollectiveRpcKwargs


B = TypeVar("B", bound=BaseModel)


def validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "invalid request: " + "; ".join(parts)
