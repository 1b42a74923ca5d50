"""Response bodies of the OpenAI routes (envelope, Gyre's token extras) and chat-message rendering."""

from __future__ import annotations

import json
import time
from typing import Any

from ..engines.base import Completion
from .schema import ChatRequest, Tool


def extras(prompt: list[int], c: Completion) -> dict[str, Any]:
    return {
        "prompt_token_ids": prompt,
        "token_ids": c.token_ids,
        "token_logprobs": c.logprobs,
        "token_versions": c.versions,
        "num_migrations": c.num_migrations,
        "engine_ids": c.engine_ids,
    }


def envelope(
    response_id: str, kind: str, model: str, choice: dict[str, Any], prompt: list[int], c: Completion
) -> dict[str, Any]:
    """The OpenAI response envelope shared by completions and chat completions (one choice)."""
    return {
        "id": response_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(c.token_ids),
            "total_tokens": len(prompt) + len(c.token_ids),
        },
    }


def finish(c: Completion, tool_calls: bool = False) -> str:
    return "tool_calls" if tool_calls else ("stop" if c.finish_reason == "stop" else "length")


def tools_message(tools: list[Tool]) -> dict[str, Any]:
    lines = [json.dumps({"name": t.function.name, "parameters": t.function.parameters or {}}) for t in tools]
    return {
        "role": "system",
        "content": "Tools (call with <tool_call>{...}</tool_call>):\n" + "\n".join(lines),
    }


def chat_messages(body: ChatRequest) -> list[dict[str, Any]]:
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    for m in messages:
        if m["role"] == "developer":
            m["role"] = "system"
    return [tools_message(body.tools), *messages] if body.tools else messages


def num_chars(value: Any) -> int:
    """Characters of every string inside a JSON-like value (a bound on its byte-token count)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(num_chars(k) + num_chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(num_chars(v) for v in value)
    return 8
