"""The tokenizer interface every part of a run shares (engine prompts, the OpenAI endpoint,
the trajectory's and trainer's vocabulary checks), and the spec that names one.

A tokenizer spec is a string: `byte` (Gyre's byte tokenizer, gyre/tokenizer.py; no files) or the
path of a directory holding a Hugging Face tokenizer (`tokenizer.json` + `tokenizer_config.json`,
usually the checkpoint directory). Guarantees of every implementation:

- `encode`/`apply_chat_template` return ids in [0, vocab_size);
- `apply_chat_template(messages, tools=...)` is deterministic: the same messages give the same ids
  in every process, so the ids the endpoint hands the engine are the ids the trainer trains;
- `parse_assistant(ids)` splits generated ids into content, reasoning (`<think>`) and tool calls
  without changing the ids (the step keeps every generated token, reasoning included).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from gyre.errors import ConfigError
from gyre.tokenizer import AssistantTurn

from .framing import ChatFraming

BYTE_SPEC = "byte"


class Tokenizer(abc.ABC):
    """Text <-> token ids, the model's chat template, and its completion parser."""

    spec: str
    """The spec this tokenizer was loaded from (`byte` or a directory path)."""
    vocab_size: int
    """Number of ids this tokenizer can produce: every id lies in [0, vocab_size)."""
    stop_ids: tuple[int, ...]
    """Ids that end an assistant turn (the default stop tokens of a generation)."""
    supports_tools: bool
    """Whether tool calls can be parsed out of completions (a tool-call parser is known)."""
    max_chars_per_token: int
    """Most characters one token decodes to: text of N characters has at least N / this many tokens."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of plain text (no special tokens added)."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of `ids`; special tokens dropped unless `skip_special` is False."""

    @abc.abstractmethod
    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Ids of an OpenAI-style conversation (and tool specs) under the model's chat template."""

    @abc.abstractmethod
    def message_ids(self, message: dict[str, Any]) -> list[int]:
        """Ids of one message alone under the chat template (a piece of an agent's id history)."""

    @abc.abstractmethod
    def framing(self) -> ChatFraming:
        """The ids around messages (prompt start, generation prompt, turn close, reasoning markers)."""

    @abc.abstractmethod
    def parse_assistant(self, ids: Sequence[int]) -> AssistantTurn:
        """Generated ids (after the generation prompt) as content, reasoning and tool calls."""


class VocabularyMismatch(ConfigError):
    """A model cannot embed every id of the run's tokenizer."""


def check_vocabulary(tokenizer: Tokenizer, vocab_size: int, where: str) -> None:
    """Raise VocabularyMismatch unless a model of `vocab_size` rows embeds every id of `tokenizer`.

    A model may have more rows than the tokenizer has ids (checkpoints pad their embeddings), never
    fewer. `where` names the setting that holds `vocab_size` (e.g. `rollout.model.vocab_size`).
    """
    if tokenizer.vocab_size > vocab_size:
        raise VocabularyMismatch(
            f"vocabulary mismatch: tokenizer {tokenizer.spec!r} has {tokenizer.vocab_size} ids but "
            f"{where} is {vocab_size}; use the model that belongs to this tokenizer or set {where} "
            f">= {tokenizer.vocab_size}"
        )
