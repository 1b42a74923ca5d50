"""Byte-level tokenizer and chat template shared by the rollout engines, the trainer and the tests.

Token ids 0..255 are the bytes of UTF-8 text; ids from 256 up are special tokens; the model's
vocabulary is padded to `VOCAB_SIZE` (512) so there is room for more specials without changing
the embedding size. Encoding is lossless and needs no files, so every process (engine, trainer,
OpenAI endpoint) tokenises identically.

Chat template (one message)::

    <role> [<think> reasoning </think>] content [<tool_call> {"name":..,"arguments":..} </tool_call>]* <eos>

where `<role>` is one of `<system>`, `<user>`, `<assistant>`, `<tool>`. A generation prompt ends
with `<assistant>`; the model's completion is the rest of that message, ending with `<eos>`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gyre.errors import InvalidArgument

VOCAB_SIZE = 512
"""Embedding rows of every Gyre model that uses this tokenizer (bytes + specials + padding)."""

NUM_BYTES = 256

PAD = 256
BOS = 257
EOS = 258
SYSTEM = 259
USER = 260
ASSISTANT = 261
TOOL = 262
THINK_OPEN = 263
THINK_CLOSE = 264
TOOL_CALL_OPEN = 265
TOOL_CALL_CLOSE = 266

SPECIAL_NAMES: dict[int, str] = {
    PAD: "<pad>",
    BOS: "<bos>",
    EOS: "<eos>",
    SYSTEM: "<system>",
    USER: "<user>",
    ASSISTANT: "<assistant>",
    TOOL: "<tool>",
    THINK_OPEN: "<think>",
    THINK_CLOSE: "</think>",
    TOOL_CALL_OPEN: "<tool_call>",
    TOOL_CALL_CLOSE: "</tool_call>",
}
ROLE_TOKENS: dict[str, int] = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}


@dataclass
class ToolCall:
    """One function call the model asked for (OpenAI shape: name + JSON-encoded arguments)."""

    name: str
    arguments: str
    id: str = ""


@dataclass
class AssistantTurn:
    """An assistant completion split into its parts."""

    content: str
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def encode(text: str) -> list[int]:
    """UTF-8 bytes of `text` as token ids (never special tokens)."""
    return list(text.encode("utf-8"))


def decode(ids: Iterable[int], *, skip_special: bool = True) -> str:
    """Text of `ids`; specials dropped (or rendered by name), invalid UTF-8 replaced by U+FFFD."""
    out = bytearray()
    for i in ids:
        if 0 <= i < NUM_BYTES:
            out.append(i)
        elif not skip_special:
            out += SPECIAL_NAMES.get(i, f"<unk{i}>").encode()
        elif i < 0 or i >= VOCAB_SIZE:
            raise InvalidArgument(f"token id {i} outside the vocabulary [0, {VOCAB_SIZE})")
    return out.decode("utf-8", errors="replace")


def message_ids(message: dict[str, Any]) -> list[int]:
    """Token ids of one message under the chat template (role token ... `<eos>`)."""
    role = message.get("role")
    if role not in ROLE_TOKENS:
        raise InvalidArgument(f"message role must be one of {sorted(ROLE_TOKENS)}, got {role!r}")
    ids = [ROLE_TOKENS[role]]
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        ids += [THINK_OPEN, *encode(str(reasoning)), THINK_CLOSE]
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    if content:
        ids += encode(str(content))
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        payload = json.dumps({"name": fn.get("name", ""), "arguments": fn.get("arguments", "")})
        ids += [TOOL_CALL_OPEN, *encode(payload), TOOL_CALL_CLOSE]
    ids.append(EOS)
    return ids


def apply_chat_template(
    messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a conversation: `<bos>`, each message, then `<assistant>` if asked.

    Messages are OpenAI-style dicts (`role`, `content`, optional `reasoning`, `tool_calls`).
    """
    ids = [BOS]
    for m in messages:
        ids += message_ids(m)
    if add_generation_prompt:
        ids.append(ASSISTANT)
    return ids


def parse_assistant(ids: Sequence[int]) -> AssistantTurn:
    """Split a completion (the tokens after `<assistant>`) into reasoning, content and tool calls.

    Parsing is forgiving: an unterminated `<think>` or `<tool_call>` runs to the end; a tool call
    whose payload is not `{"name":..,"arguments":..}` JSON is kept as a call with the raw text as
    its name-less arguments, so the caller can report it rather than lose it.
    """
    content: list[int] = []
    reasoning: list[int] = []
    calls: list[list[int]] = []
    mode = "content"
    for t in ids:
        if t == EOS:
            break
        if t == THINK_OPEN:
            mode = "think"
        elif t == THINK_CLOSE:
            mode = "content"
        elif t == TOOL_CALL_OPEN:
            mode = "call"
            calls.append([])
        elif t == TOOL_CALL_CLOSE:
            mode = "content"
        elif 0 <= t < NUM_BYTES:
            (reasoning if mode == "think" else calls[-1] if mode == "call" else content).append(t)
    tool_calls = []
    for n, raw in enumerate(calls):
        text = decode(raw)
        try:
            obj = json.loads(text)
            name, args = str(obj["name"]), obj.get("arguments", "")
            if not isinstance(args, str):
                args = json.dumps(args)
        except (ValueError, KeyError, TypeError):
            name, args = "", text
        tool_calls.append(ToolCall(name=name, arguments=args, id=f"call_{n}"))
    return AssistantTurn(content=decode(content), reasoning=decode(reasoning), tool_calls=tool_calls)
