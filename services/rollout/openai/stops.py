"""`stop` strings on top of an engine that stops only at stop ids.

The engine generates until a stop id or `max_tokens`; `cut_at_stop` then keeps the shortest prefix
of the generated ids whose text contains a stop string (that token included, as vLLM keeps it) and
the text before the stop string. The step records that prefix: the ids a harness gets back are the
ids that are trained, and tokens generated past the stop are dropped before anyone sees them.
"""

from __future__ import annotations

from dataclasses import replace

from gyre.tokenizers import Tokenizer

from ..engines.base import Completion


def cut_at_stop(
    completion: Completion, tokenizer: Tokenizer, stops: list[str]
) -> tuple[Completion, str | None]:
    """(completion cut after the token that completes the first stop string, text before it).

    Unchanged (and None) when no stop string occurs. A cut completion's finish_reason is "stop".
    """
    if not stops:
        return completion, None
    full = tokenizer.decode(completion.token_ids)
    found = [(full.find(s), s) for s in stops if s in full]
    if not found:
        return completion, None
    start, stop = min(found)
    end = start + len(stop)
    n = 1
    while n < len(completion.token_ids) and len(tokenizer.decode(completion.token_ids[:n])) < end:
        n += 1
    cut = replace(
        completion,
        token_ids=completion.token_ids[:n],
        logprobs=completion.logprobs[:n],
        versions=completion.versions[:n],
        finish_reason="stop",
    )
    return cut, full[:start]
