"""Byte-level tokenizer: lossless text, chat template, completion parsing."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre import tokenizer as tok
from gyre.errors import InvalidArgument


@given(st.text())
def test_text_round_trips_through_bytes(text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_vocab_holds_every_special_token() -> None:
    assert max(tok.SPECIAL_NAMES) < tok.VOCAB_SIZE <= 512


def test_chat_template_ends_with_generation_prompt_and_is_a_prefix_of_longer_chats() -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(msgs)
    assert ids[0] == tok.BOS and ids[-1] == tok.ASSISTANT
    longer = tok.apply_chat_template(
        [*msgs, {"role": "assistant", "content": "yo"}], add_generation_prompt=False
    )
    assert longer[: len(ids)] == ids


def test_completion_with_reasoning_and_tool_call_is_parsed() -> None:
    ids = [tok.THINK_OPEN, *tok.encode("plan"), tok.THINK_CLOSE, *tok.encode("ok")]
    ids += [
        tok.TOOL_CALL_OPEN,
        *tok.encode('{"name": "ls", "arguments": {"path": "."}}'),
        tok.TOOL_CALL_CLOSE,
        tok.EOS,
    ]
    turn = tok.parse_assistant(ids)
    assert (turn.reasoning, turn.content) == ("plan", "ok")
    assert turn.tool_calls[0].name == "ls" and '"path"' in turn.tool_calls[0].arguments


def test_unknown_role_is_rejected() -> None:
    with pytest.raises(InvalidArgument):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
