"""`stream=true`: a finished response re-told as OpenAI server-sent events.

Every sample is generated (and its step published) before the first event is sent, so a stream
carries exactly the ids of the step and an error is an ordinary HTTP error, never a broken stream.
Chat: per choice a role chunk, content one chunk per generated token piece, each tool call as one
delta (`index`, `id`, `type`, `function.name`, `function.arguments`), then a chunk with
`finish_reason` and Gyre's token extras; completions: text chunks, then the finish chunk. The last
event before `data: [DONE]` has `choices: []` and the `usage` of the whole request.
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


def chat_events(
    response: dict[str, Any], completions: list[Completion], tokenizer: Tokenizer
) -> Iterator[str]:
    head = {k: response[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
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
    yield _event({**head, "choices": [], "usage": response["usage"]})
    yield "data: [DONE]\n\n"


def completion_events(
    response: dict[str, Any], completions: list[Completion], tokenizer: Tokenizer
) -> Iterator[str]:
    head = {k: response[k] for k in ("id", "created", "model", "object")}
    for choice, c in zip(response["choices"], completions, strict=True):
        index = choice["index"]
        for piece in pieces(c.token_ids, tokenizer, choice["text"]):
            yield _event({**head, "choices": [{"index": index, "text": piece, "finish_reason": None}]})
        last = {k: v for k, v in choice.items() if k not in ("text", "index")}
        yield _event({**head, "choices": [{"index": index, "text": "", **last}]})
    yield _event({**head, "choices": [], "usage": response["usage"]})
    yield "data: [DONE]\n\n"


def sse(events: Iterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
