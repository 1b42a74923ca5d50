"""Gyre's byte tokenizer (gyre/tokenizer.py) behind the `Tokenizer` interface: what the CPU
quickstart runs. Tools are rendered as one system message listing their JSON specs, and the model
calls them with the `<tool_call>` special ids; both are byte-template conventions, not a model's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gyre import tokenizer as byte_tokens
from gyre.tokenizer import AssistantTurn

from .base import BYTE_SPEC, Tokenizer
from .framing import ChatFraming


def tools_message(tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The system message that lists `tools` (OpenAI tool specs) for the byte chat template."""
    lines = []
    for tool in tools:
        fn = tool.get("function", tool)
        lines.append(json.dumps({"name": fn.get("name", ""), "parameters": fn.get("parameters") or {}}))
    return {
        "role": "system",
        "content": "Tools (call with <tool_call>{...}</tool_call>):\n" + "\n".join(lines),
    }


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255, specials from 256, vocabulary padded to 512; stop id `<eos>`."""

    spec = BYTE_SPEC
    vocab_size = byte_tokens.VOCAB_SIZE
    stop_ids = (byte_tokens.EOS,)
    supports_tools = True
    max_chars_per_token = 1

    def encode(self, text: str) -> list[int]:
        return byte_tokens.encode(text)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return byte_tokens.decode(ids, skip_special=skip_special)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        rendered = [tools_message(tools), *messages] if tools else list(messages)
        return byte_tokens.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt)

    def message_ids(self, message: dict[str, Any]) -> list[int]:
        return byte_tokens.message_ids(message)

    def framing(self) -> ChatFraming:
        return ChatFraming(
            begin_ids=(byte_tokens.BOS,),
            generation_prompt_ids=(byte_tokens.ASSISTANT,),
            close_after_stop_ids=(),
            close_ids=(byte_tokens.EOS,),
            think_open=byte_tokens.THINK_OPEN,
            think_close=byte_tokens.THINK_CLOSE,
        )

    def parse_assistant(self, ids: Sequence[int]) -> AssistantTurn:
        return byte_tokens.parse_assistant(ids)
