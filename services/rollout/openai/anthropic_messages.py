"""`POST /v1/messages`: the Anthropic Messages API, translated onto the chat-completions path.

So that an Anthropic-client harness can be trained unchanged: the request is translated into the
same `ChatRequest` `/v1/chat/completions` takes, run through the same code (`routes.chat_call`:
the run's chat template, the router, the tool-call parser, one stored step per call), and the
chat result translated back into an Anthropic `Message`. The stored step is exactly the one the
equivalent chat completion would store.

Supported: `model`, `max_tokens` (required), `system` (a string or text blocks), `messages` whose
content is a string or blocks: `text`; `thinking` (assistant; its text becomes the message's
`reasoning_content`, the signature is ignored); `tool_use` (assistant; -> `tool_calls`, `input` as
JSON arguments); `tool_result` (user; -> a `tool` message with `tool_call_id`, content a string or
text blocks; `is_error` has no chat counterpart, the result's text is rendered as is). Text blocks
of one turn are concatenated as the chat route concatenates text parts; `cache_control` and
`citations` are ignored (hints only), as are `service_tier`, `speed`, `inference_geo` and other
fields Gyre does not know. `tools` [{name, description, input_schema}] (custom tools),
`tool_choice` `{"type": "auto"}` or `{"type": "none"}` (as the chat route honours `auto`/`none`),
`stop_sequences` (at most 8), `temperature` (0..1; default 1.0, as on the chat route; newer
clients no longer expose it: send it in `extra_body`), `top_p`, `stream`, `metadata.user_id` (names
the execution, as `user` does on the chat route). Per-execution routing is the chat route's: a
per-execution base URL `http://host:port/x/<token>` (the client appends `/v1/messages`), the
token as `x-api-key`, or the header `X-Gyre-Execution-Id`.

Refused with HTTP 400 naming the field, in Anthropic's error body (`{"type": "error", "error":
{"type": "invalid_request_error", "message"}}`): `tool_choice` `any`/`tool`,
`disable_parallel_tool_use: true`, `top_k`, `thinking` other than disabled, `metadata` keys other
than `user_id`, `container`, `mcp_servers`, `context_management`, `output_format`, `output_config`
(`effort`, `format`), blocks other
than the above (`image`, `document`, `redacted_thinking`, server-tool blocks, ...), non-custom
(server) tools, and a last message from the assistant (prefill cannot be continued).

The response: `content` blocks `thinking` (the model's reasoning, if any, `signature` empty), `text`,
`tool_use` {id (the chat route's `call_<n>_<call_seq>`), name, input}; `stop_reason` `tool_use`,
`stop_sequence` (with `stop_sequence`), `end_turn` or `max_tokens` (a call that is not complete, or
a turn cut by `max_tokens`, comes back as text: tool_calls.py); `usage`; and Gyre's token
extras (`prompt_token_ids`, `token_ids`, ...) as extra fields. `stream: true`: the whole completion
is generated (and its step stored) first, then re-told as Anthropic SSE events (`message_start`,
carrying the extras; per block `content_block_start`, `content_block_delta` with `thinking_delta` /
`text_delta` (one per token piece) / `input_json_delta`, `content_block_stop`; `message_delta`
with the stop reason and usage; `message_stop`), so an error is an ordinary HTTP error.

`POST /v1/messages/count_tokens` ({model, system, messages, tools, tool_choice, thinking}) answers
`{"input_tokens": n}`: the length of the very prompt `/v1/messages` renders for the same fields
(its `usage.input_tokens`), refused on the same shapes; it generates nothing and opens no execution.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from gyre.errors import InvalidArgument
from gyre.tokenizers import Tokenizer

from ..engines.base import Completion
from .responses import extras
from .schema import ChatRequest, validation_message
from .streaming import pieces

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
    413: "request_too_large",
}  # fmt: skip


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


# -- request models ------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Block(_Body):
    """A content block of any type; what each type needs is checked in `_blocks`."""

    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(_Body):
    type: str | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Body):
    """`POST /v1/messages`. Known fields Gyre does not honour are `Any` and refused by `_refuse`."""

    model: str | None = None
    max_tokens: int = Field(ge=1)
    system: str | list[Block] | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(
        None, max_length=8
    )
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=1e-6, le=1)
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    top_k: Any = None
    thinking: Any = None
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    output_format: Any = None
    output_config: Any = None


class CountTokensRequest(_Body):
    """`POST /v1/messages/count_tokens`: what a Messages request renders into its prompt."""

    model: str | None = None
    system: str | list[Block] | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Any = None

    def as_messages_request(self) -> MessagesRequest:
        """The Messages request whose prompt this counts (`max_tokens` plays no part in it)."""
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        return MessagesRequest.model_validate({**fields, "max_tokens": 1})


_REFUSED: list[tuple[str, str]] = [
    ("top_k", "top-k sampling is not applied; omit it"),
    ("container", "no server-side containers"),
    ("mcp_servers", "no server-side MCP connectors"),
    ("context_management", "no server-side context management"),
    ("output_format", "no constrained decoding"),
]


def _unsupported(field: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"unsupported request field {field!r}: {why}")


def _refuse(body: MessagesRequest) -> None:
    for name, why in _REFUSED:
        if getattr(body, name) is not None:
            raise _unsupported(name, why)
    thinking = body.thinking
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise _unsupported(
            "thinking",
            "reasoning budgets are not applied; the model's reasoning comes back as thinking blocks",
        )
    for key, value in (body.output_config or {}).items() if isinstance(body.output_config, dict) else ():
        if value is not None:
            raise _unsupported(f"output_config.{key}", "no effort levels or constrained decoding")
    for key in body.metadata or {}:
        if key != "user_id":
            raise _unsupported(f"metadata.{key}", "only metadata.user_id")
    choice = body.tool_choice
    if choice is not None and choice.type in ("any", "tool"):
        raise _unsupported(
            "tool_choice", "only 'auto' and 'none' are honoured (no forced or named tool calls)"
        )
    if choice is not None and choice.disable_parallel_tool_use:
        raise _unsupported("tool_choice.disable_parallel_tool_use", "calls cannot be limited to one")
    for i, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom"):
            raise _unsupported(f"tools[{i}].type", f"{tool.type!r}: custom tools only (no server tools)")
        if tool.input_schema is None:
            raise InvalidArgument(f"invalid request: tools[{i}].input_schema: a custom tool needs one")
    if body.messages[-1].role == "assistant":
        raise _unsupported("messages[-1].role", "a last assistant message (prefill) cannot be continued")


# -- request -> chat request ---------------------------------------------------------------------
def _texts(blocks: str | list[Block] | None, where: str) -> str:
    """The text of a string or of text blocks (concatenated); 400 naming any other block."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    for j, block in enumerate(blocks):
        if block.type != "text":
            raise _unsupported(f"{where}[{j}].type", f"{block.type!r}: text blocks only")
    return "".join(block.text or "" for block in blocks)


def _assistant(blocks: list[Block], where: str) -> dict[str, Any]:
    """An assistant turn's blocks as one chat message: content, reasoning_content, tool_calls."""
    text, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        if block.type == "text":
            text.append(block.text or "")
        elif block.type == "thinking":
            reasoning.append(block.thinking or "")
        elif block.type == "tool_use":
            if not block.id or not block.name:
                raise InvalidArgument(f"{where}[{j}]: a tool_use block needs an id and a name")
            arguments = json.dumps(block.input or {}, ensure_ascii=False)
            calls.append(
                {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
            )
        else:
            raise _unsupported(
                f"{where}[{j}].type", f"{block.type!r}: text, thinking and tool_use blocks only"
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[Block], where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    """A user turn's blocks as chat messages, in order: runs of text blocks -> one user message
    each, each tool_result -> a `tool` message (with the name of the call it answers, if known)."""
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for j, block in enumerate(blocks):
        if block.type == "text":
            text.append(block.text or "")
            continue
        if block.type != "tool_result":
            raise _unsupported(f"{where}[{j}].type", f"{block.type!r}: text and tool_result blocks only")
        if text:
            out.append({"role": "user", "content": "".join(text)})
            text = []
        if not block.tool_use_id:
            raise InvalidArgument(f"{where}[{j}]: a tool_result block needs a tool_use_id")
        message = {"role": "tool", "tool_call_id": block.tool_use_id}
        if block.tool_use_id in names:
            message["name"] = names[block.tool_use_id]
        message["content"] = _texts(block.content, f"{where}[{j}].content")
        out.append(message)
    if text:
        out.append({"role": "user", "content": "".join(text)})
    return out


def chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI-style chat messages (system first, if any)."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        out.append({"role": "system", "content": _texts(body.system, "system")})
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool messages answering it
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            message = _assistant(m.content, where)
            names.update({c["id"]: c["function"]["name"] for c in message.get("tool_calls", [])})
            out.append(message)
        else:
            out.extend(_user(m.content, where, names))
    return out


def to_chat_request(body: MessagesRequest) -> ChatRequest:
    """The `ChatRequest` the chat route would get for this Messages request (400 if not honoured)."""
    _refuse(body)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body),
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stop": body.stop_sequences,
        "user": (body.metadata or {}).get("user_id"),
    }
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in body.tools
        ]
    if body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice.type
    try:
        return ChatRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        raise InvalidArgument(validation_message(exc)) from None


# -- chat result -> Message ----------------------------------------------------------------------
def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a tool_use `input`: always a JSON object (tool_calls.is_complete)."""
    parsed = json.loads(arguments)
    if not isinstance(parsed, dict):
        raise TypeError(f"tool call arguments are not a JSON object: {arguments[:80]!r}")
    return parsed


def _stop_sequence(c: Completion, stop_text: str, tokenizer: Tokenizer, stops: list[str]) -> str | None:
    """The stop sequence that cut the completion: the one right after the text before the cut."""
    rest = tokenizer.decode(c.token_ids)[len(stop_text) :]
    found = [s for s in stops if rest.startswith(s)]
    return min(found) if found else None


def to_message(
    response: dict[str, Any],
    sample: tuple[Completion, str | None],
    prompt: list[int],
    tokenizer: Tokenizer,
    stops: list[str],
) -> dict[str, Any]:
    """The Anthropic Message of a chat result (its first and only choice), Gyre's extras included."""
    choice = response["choices"][0]
    chat = choice["message"]
    c, stop_text = sample
    content: list[dict[str, Any]] = []
    if chat.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": chat["reasoning_content"], "signature": ""})
    if chat.get("content"):
        content.append({"type": "text", "text": chat["content"]})
    for call in chat.get("tool_calls") or []:
        fn = call["function"]
        content.append(
            {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": _input(fn["arguments"])}
        )
    stop_sequence = None
    if choice["finish_reason"] == "tool_calls":
        stop_reason = "tool_use"
    elif stop_text is not None:
        stop_reason, stop_sequence = "stop_sequence", _stop_sequence(c, stop_text, tokenizer, stops)
    else:
        stop_reason = "end_turn" if c.finish_reason == "stop" else "max_tokens"
    return {
        "id": "msg_" + response["id"].removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": response["model"],
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": len(prompt), "output_tokens": len(c.token_ids)},
        **extras(prompt, c),
    }


# -- streaming -----------------------------------------------------------------------------------
def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n"


def _block_events(index: int, block: dict[str, Any], c: Completion, tokenizer: Tokenizer) -> Iterator[str]:
    """One content block as start, deltas, stop."""
    kind = block["type"]
    if kind == "thinking":
        start: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [{"type": "thinking_delta", "thinking": block["thinking"]}]
    elif kind == "text":
        start = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": p} for p in pieces(c.token_ids, tokenizer, block["text"])]
    else:
        start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        deltas = [
            {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        ]
    yield _event("content_block_start", {"index": index, "content_block": start})
    for delta in deltas:
        yield _event("content_block_delta", {"index": index, "delta": delta})
    yield _event("content_block_stop", {"index": index})


def message_events(message: dict[str, Any], c: Completion, tokenizer: Tokenizer) -> Iterator[str]:
    """A finished Message re-told as Anthropic server-sent events (see the module docstring)."""
    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {"input_tokens": usage["input_tokens"], "output_tokens": 0}
    yield _event("message_start", {"message": start})
    for index, block in enumerate(message["content"]):
        yield from _block_events(index, block, c, tokenizer)
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    yield _event("message_delta", {"delta": delta, "usage": usage})
    yield _event("message_stop", {})
