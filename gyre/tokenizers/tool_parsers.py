"""Completion text -> reasoning, content and OpenAI tool calls, one parser per tool-call format,
chosen by model family (as vLLM's tool parsers are).

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2,
  Qwen2.5, Qwen3). Several blocks are parallel calls, in order. A block whose payload is not that
  JSON is kept as a call with an empty name and the raw text as arguments, so the caller can
  report it rather than lose it; an unterminated last block runs to the end of the text.

Reasoning: text before `</think>` (after an optional opening `<think>`) is `reasoning`, for every
family; the ids are not touched, only the returned text is split.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from gyre.tokenizer import AssistantTurn, ToolCall

ToolParser = Callable[[str], AssistantTurn]
"""Completion text (special tokens removed, tool-call markers kept) -> its parts."""

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, rest) of a completion: the text up to `</think>`, without the `<think>` marker."""
    if "</think>" not in text:
        if text.lstrip().startswith("<think>"):  # unterminated: all of it is reasoning
            return text.lstrip()[len("<think>") :].strip(), ""
        return "", text
    reasoning, rest = text.split("</think>", 1)
    reasoning = reasoning.strip()
    if reasoning.startswith("<think>"):
        reasoning = reasoning[len("<think>") :]
    return reasoning.strip(), rest


def _call(payload: str, index: int) -> ToolCall:
    try:
        obj = json.loads(payload)
        name = str(obj["name"])
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
    except (ValueError, KeyError, TypeError):
        name, arguments = "", payload
    return ToolCall(name=name, arguments=arguments, id=f"call_{index}")


def parse_hermes(text: str) -> AssistantTurn:
    """Hermes/Qwen tool-call blocks and `<think>` reasoning out of a completion's text."""
    reasoning, rest = split_reasoning(text)
    calls = [_call(m.group(1).strip(), n) for n, m in enumerate(_TOOL_CALL.finditer(rest))]
    content = _TOOL_CALL.sub("", rest).strip() if calls else rest.strip()
    return AssistantTurn(content=content, reasoning=reasoning, tool_calls=calls)


def parse_plain(text: str) -> AssistantTurn:
    """No tool-call format: reasoning split off, the rest is content."""
    reasoning, rest = split_reasoning(text)
    return AssistantTurn(content=rest.strip(), reasoning=reasoning)


TOOL_PARSERS: dict[str, ToolParser] = {"hermes": parse_hermes}
"""Tool-call formats by name."""

FAMILY_TOOL_PARSER: dict[str, str] = {"qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes"}
"""Tool-call format of each model family (`model_type` of the checkpoint's config.json)."""


def tool_parser_for(family: str | None) -> ToolParser | None:
    """The tool-call parser of a model family, or None when the family has no known format."""
    name = FAMILY_TOOL_PARSER.get(family or "")
    return TOOL_PARSERS[name] if name else None
