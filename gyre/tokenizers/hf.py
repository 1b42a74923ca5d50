"""A Hugging Face tokenizer (`transformers.AutoTokenizer`) from a checkpoint directory, with the
checkpoint's own chat template and its family's tool-call parser.

Loaded from local files only (`local_files_only=True`: no hub access). Stop ids are the union of
the tokenizer's `eos_token_id` and `generation_config.json`'s `eos_token_id` (an int or a list),
in that order. The model family is `model_type` of the directory's config.json; it picks the
tool-call parser (gyre/tokenizers/tool_parsers.py).

The chat template is rendered to text and that text encoded without added specials, which is what
`transformers` does itself; `tools` are passed to the template as OpenAI tool specs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gyre.errors import ConfigError
from gyre.tokenizer import AssistantTurn

from .base import Tokenizer
from .framing import ChatFraming
from .tool_parsers import parse_plain, tool_parser_for


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class HFTokenizer(Tokenizer):
    """`AutoTokenizer.from_pretrained(directory)` behind the `Tokenizer` interface."""

    def __init__(self, directory: str | Path) -> None:
        import transformers

        self.spec = str(directory)
        path = Path(directory)
        self._tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if not getattr(self._tok, "chat_template", None):
            raise ConfigError(f"tokenizer {self.spec!r} has no chat template (tokenizer_config.json)")
        self.vocab_size = len(self._tok)
        generation = _json(path / "generation_config.json")
        stops = [*_ids(self._tok.eos_token_id), *_ids(generation.get("eos_token_id"))]
        self.stop_ids = tuple(dict.fromkeys(stops))
        if not self.stop_ids:
            raise ConfigError(
                f"tokenizer {self.spec!r} names no eos token (tokenizer or generation_config.json)"
            )
        self.max_chars_per_token = max(
            1, max(len(self._tok.decode([i], skip_special_tokens=False)) for i in range(self.vocab_size))
        )
        self.family = str(_json(path / "config.json").get("model_type", ""))
        self._tool_parser = tool_parser_for(self.family)
        self.supports_tools = self._tool_parser is not None

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special))

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template's text of a conversation (what `apply_chat_template` encodes)."""
        text = self._tok.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        return str(text)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        text = self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        return self.encode(text)

    def message_ids(self, message: dict[str, Any]) -> list[int]:
        return self.encode(self.render_chat([message], add_generation_prompt=False))

    def framing(self) -> ChatFraming:
        """Read off the template by rendering probe conversations; ConfigError if it is not ChatML-like
        (a generation prompt that does not extend the conversation, or a turn not closed after its content)."""
        user, reply = {"role": "user", "content": "\x00u"}, {"role": "assistant", "content": "\x00a"}
        alone = self.render_chat([user], add_generation_prompt=False)
        prompted = self.render_chat([user])
        answered = self.render_chat([user, reply], add_generation_prompt=False)
        generation = prompted[len(alone) :]
        turn = answered[len(alone) :]
        if (
            not prompted.startswith(alone)
            or not answered.startswith(alone)
            or not turn.startswith(generation + "\x00a")
        ):
            raise ConfigError(
                f"tokenizer {self.spec!r}: its chat template cannot be framed message by message"
            )
        close = turn[len(generation) + 2 :]
        eos = self.decode([self.stop_ids[0]], skip_special=False)
        after_stop = close[len(eos) :] if close.startswith(eos) else close
        found = [self._tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>")]
        think = [t if isinstance(t, int) and t != self._tok.unk_token_id else None for t in found]
        return ChatFraming(
            begin_ids=(),
            generation_prompt_ids=tuple(self.encode(generation)),
            close_after_stop_ids=tuple(self.encode(after_stop)),
            close_ids=tuple(self.encode(close)),
            think_open=think[0] if think[1] is not None else None,
            think_close=think[1] if think[0] is not None else None,
        )

    def parse_assistant(self, ids: Sequence[int]) -> AssistantTurn:
        stops = set(self.stop_ids)
        kept = list(ids)
        for n, t in enumerate(kept):
            if t in stops:
                kept = kept[:n]
                break
        text = self.decode(kept)
        return (self._tool_parser or parse_plain)(text)
