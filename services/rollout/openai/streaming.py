"""`stream=true`: a finished response re-told as OpenAI server-sent events.

Every sample is generated (and its step published) before the first event is sent, so a stream
carries exactly the ids of the step and an error is an ordinary HTTP error, never a broken stream.
Chat: per choice a role chunk, content one chunk per generated token piece, each tool call as one
delta (`index`, `id`, `type`, `function.name`, `function.arguments`), then a chunk with
`finish_reason` and Gyre's token extras; completions: text chunks, then the finish chunk. Only with
`stream_options.include_usage` (as OpenAI does): every chunk carries `usage: null` and the last event
before `data: [DONE]` has `choices: []` and the `usage` of the whole request; without it no chunk has
empty `choices`, so the common `chunk.choices[0]` loop never trips.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi.responses import StreamingResponse

from gyre.tokenizers import Tokenizer

from ..engines.base import Completion


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def pieces(ids: list[int], tokenizer: Tokenizer, text: str) -> list[str]:
    """`text` split where each generated token ends (decoded prefixes), for one chunk per token."""
    out, done = [], 0
    for n in range(1, len(ids) + 1):
        end = min(len(text), len(tokenizer.decode(ids[:n])))
        if end > done:
            out.append(text[done:end])
            done = end
    if done < len(text):
        out.append(text[done:])
    return out


def _usage_head(head: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    return {**head, "usage": None} if include_usage else head


def _usage_events(head: dict[str, Any], response: dict[str, Any], include_usage: bool) -> Iterator[str]:
    if include_usage:
        yield _event({**head, "choices": [], "usage": response["usage"]})
    yield "data: [DONE]\n\n"


def chat_events(
    response: dict[str, Any], completions: list[Completion], tokenizer: Tokenizer, include_usage: bool
) -> Iterator[str]:
    head = {k: response[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    head = _usage_head(head, include_usage)
    for choice, c in zip(response["choices"], completions, strict=True):
        index, message = choice["index"], choice["message"]
        yield _event({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}}]})
        if message.get("reasoning_content"):
            delta = {"reasoning_content": message["reasoning_content"]}
            yield _event({**head, "choices": [{"index": index, "delta": delta}]})
        for piece in pieces(c.token_ids, tokenizer, message.get("content") or ""):
            yield _event({**head, "choices": [{"index": index, "delta": {"content": piece}}]})
        for n, call in enumerate(message.get("tool_calls") or []):
            delta = {"tool_calls": [{"index": n, **call}]}
            yield _event({**head, "choices": [{"index": index, "delta": delta}]})
        last = {k: v for k, v in choice.items() if k not in ("message", "index")}
        yield _event({**head, "choices": [{"index": index, "delta": {}, **last}]})
    yield from _usage_events(head, response, include_usage)


def completion_events(
    response: dict[str, Any], completions: list[Completion], tokenizer: Tokenizer, include_usage: bool
) -> Iterator[str]:
    head = _usage_head({k: response[k] for k in ("id", "created", "model", "object")}, include_usage)
    for choice, c in zip(response["choices"], completions, strict=True):
        index = choice["index"]
        for piece in pieces(c.token_ids, tokenizer, choice["text"]):
            yield _event({**head, "choices": [{"index": index, "text": piece, "finish_reason": None}]})
        last = {k: v for k, v in choice.items() if k not in ("text", "index")}
        yield _event({**head, "choices": [{"index": index, "text": "", **last}]})
    yield from _usage_events(head, response, include_usage)


def sse(events: Iterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
