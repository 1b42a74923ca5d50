"""Response bodies of the OpenAI routes: the envelope, choices (content, reasoning, parsed tool
calls, log-probs), Gyre's token extras, and the request messages as the chat template takes them."""

from __future__ import annotations

import time
from typing import Any

from gyre.tokenizers import Tokenizer

from ..engines.base import Completion
from .schema import ChatRequest
from .tool_calls import api_turn


def extras(prompt: list[int], c: Completion) -> dict[str, Any]:
    """Gyre's token extras of one sample: exactly the ids the engine saw and produced."""
    return {
        "prompt_token_ids": prompt,
        "token_ids": c.token_ids,
        "token_logprobs": c.logprobs,
        "token_versions": c.versions,
        "num_migrations": c.num_migrations,
        "engine_ids": c.engine_ids,
    }


def usage(prompt: list[int], completions: list[Completion]) -> dict[str, int]:
    generated = sum(len(c.token_ids) for c in completions)
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": generated,
        "total_tokens": len(prompt) + generated,
    }


def envelope(
    response_id: str,
    kind: str,
    model: str,
    choices: list[dict[str, Any]],
    prompt: list[int],
    cs: list[Completion],
) -> dict[str, Any]:
    """The OpenAI response envelope shared by completions and chat completions."""
    return {
        "id": response_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt, cs),
    }


def finish(c: Completion, tool_calls: bool = False) -> str:
    return "tool_calls" if tool_calls else ("stop" if c.finish_reason == "stop" else "length")


def text_of(content: Any) -> str | None:
    """A message's content as one string (text parts joined), None when absent."""
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content)
    return content if content is None else str(content)


def chat_messages(body: ChatRequest) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them: `developer` -> `system`, content
    parts joined, `tool_call_id` and `name` of tool messages and assistant `tool_calls` kept."""
    messages = []
    for m in body.messages:
        message = m.model_dump(exclude_none=True)
        if message["role"] == "developer":
            message["role"] = "system"
        if "content" in message:
            message["content"] = text_of(message["content"])
        messages.append(message)
    return messages


def tool_specs(body: ChatRequest) -> list[dict[str, Any]] | None:
    """The tools the template renders: none when absent or `tool_choice` is 'none'."""
    if not body.tools or body.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def chat_choice(
    index: int, c: Completion, stop_text: str | None, tokenizer: Tokenizer, call_seq: int, parse_tools: bool
) -> dict[str, Any]:
    """One chat choice: content, `reasoning_content` (the `<think>` text; its tokens stay in the
    step), parsed `tool_calls` (ids unique per execution: `call_<n>_<call_seq>`), finish_reason.

    Only complete calls of a finished turn come back as calls; else the text does (tool_calls.py)."""
    turn = api_turn(tokenizer, c) if parse_tools else tokenizer.parse_assistant(c.token_ids)
    content = turn.content
    if stop_text is not None and content:  # the stop string and what followed it are not content
        content = content[: max(0, len(content) - (len(tokenizer.decode(c.token_ids)) - len(stop_text)))]
    calls = turn.tool_calls if parse_tools else []
    if not parse_tools and turn.tool_calls:  # tool_choice 'none': the raw text is the content
        content = tokenizer.decode(c.token_ids) if stop_text is None else stop_text
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    if calls:
        message["tool_calls"] = [
            {
                "id": f"{call.id}_{call_seq}",
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in calls
        ]
    return {"index": index, "message": message, "finish_reason": finish(c, bool(calls))}


def chat_logprobs(c: Completion, tokenizer: Tokenizer) -> dict[str, Any]:
    content = []
    for t, lp in zip(c.token_ids, c.logprobs, strict=True):
        text = tokenizer.decode([t], skip_special=False)
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content}


def completion_logprobs(c: Completion, tokenizer: Tokenizer) -> dict[str, Any]:
    return {
        "tokens": [tokenizer.decode([t], skip_special=False) for t in c.token_ids],
        "token_logprobs": c.logprobs,
        "top_logprobs": None,
        "text_offset": None,
    }


def num_chars(value: Any) -> int:
    """Characters of every string inside a JSON-like value (bounds its token count from below)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(num_chars(k) + num_chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(num_chars(v) for v in value)
    return 8
