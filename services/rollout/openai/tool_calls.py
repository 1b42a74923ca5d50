"""Which tool calls the API returns as calls, and the text it returns in their place.

The tokenizer's parser (gyre/tokenizers) is forgiving on purpose: it keeps a block it cannot read
as a call with an empty name, so the built-in environments can tell the model what went wrong. A
client cannot: an empty name is not a tool call in either API, and the block would be refused when
the client sends it back. So, at the API boundary, a turn's calls go back as calls only when the
model finished writing them:

- the turn ended on a stop token (a turn cut by `max_tokens` is not a finished call, however far
  its JSON got), and
- every call has a name (1-128 characters, no whitespace or control characters) and arguments that
  are a JSON object (the Anthropic `input`; OpenAI's `arguments` as a JSON text).

Otherwise the whole turn (its reasoning apart) comes back as text content, as the tokenizer decodes
it: with a Hugging Face template the `<tool_call>` markers are text and stay in it; the byte
tokenizer's markers are special tokens, not text, and are dropped as every special is. The finish
reason is then `length` / `max_tokens` when the turn was cut, else `stop` / `end_turn`; never
`tool_calls` / `tool_use` without a call. Every call Gyre returns is thus one it accepts back
verbatim in the next request. None of this touches the step: it is stored, with exactly the ids the
engine produced, before the response is rendered.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from gyre.tokenizer import AssistantTurn, ToolCall
from gyre.tokenizers import Tokenizer
from gyre.tokenizers.tool_parsers import split_reasoning

from ..engines.base import Completion

MAX_NAME_CHARS = 128


def is_complete(call: ToolCall) -> bool:
    """A call a client can run and send back: a plain name, arguments a JSON object."""
    name = call.name
    if not 0 < len(name) <= MAX_NAME_CHARS or any(ch.isspace() or not ch.isprintable() for ch in name):
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except ValueError:
        return False


def _without_reasoning(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The text of a completion (up to its stop token) with the reasoning span taken out."""
    stops = set(tokenizer.stop_ids)
    kept = list(ids)
    for n, t in enumerate(kept):
        if t in stops:
            kept = kept[:n]
            break
    framing = tokenizer.framing()
    opener, closer = framing.think_open, framing.think_close
    if opener is None or closer is None:  # markers are text (or absent): split the text
        return split_reasoning(tokenizer.decode(kept))[1]
    if closer in kept:
        end = kept.index(closer)
        start = kept.index(opener) if opener in kept[:end] else 0
        kept = kept[:start] + kept[end + 1 :]
    elif opener in kept:  # unterminated reasoning runs to the end
        kept = kept[: kept.index(opener)]
    return tokenizer.decode(kept)


def api_turn(tokenizer: Tokenizer, c: Completion) -> AssistantTurn:
    """The turn as the API returns it: the parser's when every call is complete and the turn ended
    on a stop token; else no calls and the turn's text (reasoning apart) as content."""
    turn = tokenizer.parse_assistant(c.token_ids)
    if not turn.tool_calls or (c.finish_reason == "stop" and all(map(is_complete, turn.tool_calls))):
        return turn
    return AssistantTurn(content=_without_reasoning(tokenizer, c.token_ids), reasoning=turn.reasoning)
