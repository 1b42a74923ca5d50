"""How a tokenizer's chat template frames one message, so an agent can keep its history as ids
(message by message, never re-tokenising what the model generated) and still speak the model's
own template.

A prompt is `begin_ids + message ids... + generation_prompt_ids`; an assistant turn in the history
is `generation_prompt_ids + completion ids + close ids`, where the close ids are
`close_after_stop_ids` when the completion ended with a stop id and `close_ids` when it was cut by
`max_tokens` (for ChatML: `"\\n"` and `"<|im_end|>\\n"`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFraming:
    """The fixed id sequences around messages of one chat template (see the module docstring)."""

    begin_ids: tuple[int, ...]
    generation_prompt_ids: tuple[int, ...]
    close_after_stop_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    think_open: int | None = None
    """The single id that opens reasoning (None: reasoning is not one token and cannot be stripped)."""
    think_close: int | None = None

    def assistant_turn(self, completion: list[int], stop_ids: tuple[int, ...]) -> list[int]:
        """The history ids of one assistant turn: generation prompt, completion, close."""
        ended = bool(completion) and completion[-1] in stop_ids
        return [
            *self.generation_prompt_ids,
            *completion,
            *(self.close_after_stop_ids if ended else self.close_ids),
        ]

    def strip_reasoning(self, ids: list[int]) -> list[int]:
        """`ids` without the spans from `think_open` to `think_close` (both included)."""
        if self.think_open is None or self.think_close is None:
            return ids
        out, inside = [], False
        for t in ids:
            if t == self.think_open:
                inside = True
            elif t == self.think_close:
                inside = False
            elif not inside:
                out.append(t)
        return out
