"""The `Tokenizer` interface: the byte tokenizer as before, the Hugging Face one on the project's
own tiny checkpoint (a BPE trained on the shipped corpus, Qwen-style chat template with tools),
the Hermes/Qwen tool-call parser, and the startup refusal of a vocabulary that does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from gyre import tokenizer as byte_tokens
from gyre.errors import ConfigError
from gyre.tokenizers import VocabularyMismatch, check_vocabulary, load_tokenizer
from gyre.tokenizers.tool_parsers import parse_hermes, tool_parser_for
from tests.helpers.tiny_hf import tiny_qwen2_dir

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "two cities, two calls",
        "tool_calls": [
            {
                "id": "c0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c0", "name": "get_weather", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "rain"},
]


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return tiny_qwen2_dir()


def test_the_byte_tokenizer_keeps_todays_ids() -> None:
    t = load_tokenizer("byte")
    messages = [{"role": "user", "content": "hi"}]
    assert t.vocab_size == byte_tokens.VOCAB_SIZE and t.stop_ids == (byte_tokens.EOS,)
    assert t.apply_chat_template(messages) == byte_tokens.apply_chat_template(messages)
    assert t.encode("hé") == byte_tokens.encode("hé") and t.decode(t.encode("hé")) == "hé"


def test_the_hf_tokenizer_reads_vocabulary_and_stop_ids_from_the_checkpoint(ckpt: Path) -> None:
    t = load_tokenizer(str(ckpt))
    hf = transformers.AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
    generation = json.loads((ckpt / "generation_config.json").read_text())
    assert (
        t.vocab_size == len(hf)
        and t.vocab_size <= json.loads((ckpt / "config.json").read_text())["vocab_size"]
    )
    assert t.stop_ids[0] == hf.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert set(t.stop_ids) == {hf.eos_token_id, *generation["eos_token_id"]}
    assert t.supports_tools and t.family == "qwen2"  # type: ignore[attr-defined]


def test_the_chat_template_renders_tools_calls_and_results_and_its_ids_are_transformers_own(
    ckpt: Path,
) -> None:
    t = load_tokenizer(str(ckpt))
    hf = transformers.AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
    ids = t.apply_chat_template(CONVERSATION, tools=TOOLS)
    text = hf.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert t.decode(ids, skip_special=False) == text
    assert '"name": "get_weather"' in text and "<tools>" in text and text.count("<tool_response>") == 2
    assert text.count("<|im_start|>user") == 2  # the two tool results share one user turn
    assert "<think>\ntwo cities, two calls\n</think>" in text and text.endswith("<|im_start|>assistant\n")
    assert len(ids) < len(text) / 2  # a trained BPE, not bytes


def test_generated_tool_calls_and_reasoning_are_parsed_from_the_ids(ckpt: Path) -> None:
    t = load_tokenizer(str(ckpt))
    text = (
        '<think>\nlook both up\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    ids = [*t.encode(text), t.stop_ids[0], *t.encode("ignored after the stop")]
    turn = t.parse_assistant(ids)
    assert turn.reasoning == "look both up" and turn.content == "Checking."
    assert [(c.name, json.loads(c.arguments), c.id) for c in turn.tool_calls] == [
        ("get_weather", {"city": "Paris"}, "call_0"),
        ("get_weather", {"city": "Rome"}, "call_1"),
    ]


def test_the_hermes_parser_keeps_a_malformed_call_and_knows_its_families() -> None:
    turn = parse_hermes("<tool_call>not json</tool_call>")
    assert turn.tool_calls[0].name == "" and turn.tool_calls[0].arguments == "not json"
    assert (
        parse_hermes("plain answer").tool_calls == []
        and parse_hermes("plain answer").content == "plain answer"
    )
    assert tool_parser_for("qwen3") is parse_hermes and tool_parser_for("llama") is None


def test_a_model_too_small_for_the_tokenizer_is_refused_naming_both_sizes(ckpt: Path) -> None:
    t = load_tokenizer(str(ckpt))
    check_vocabulary(t, t.vocab_size, "x")  # equal fits; a padded embedding fits too
    with pytest.raises(VocabularyMismatch, match=rf"{t.vocab_size} ids.*rollout.model.vocab_size is 512"):
        check_vocabulary(t, 512, "rollout.model.vocab_size")
    with pytest.raises(ConfigError, match="not 'byte'"):
        load_tokenizer(str(ckpt / "missing"))


def test_the_agent_keeps_its_history_as_ids_under_the_checkpoints_own_template(ckpt: Path) -> None:
    from services.rollout.agent import AgentConfig, Conversation

    t = load_tokenizer(str(ckpt))
    hf = transformers.AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
    opening = [{"role": "system", "content": "Pick an action."}, {"role": "user", "content": "cue: b"}]
    conv = Conversation(AgentConfig(stop_token_ids=t.stop_ids), t)
    conv.add_opening(opening)
    first = conv.prompt()
    reply = [*t.encode("action 2"), t.stop_ids[0]]  # ended by its stop id
    conv.add_turn(reply, [{"role": "user", "content": "cue: c"}])
    second = conv.prompt()
    assert second[: len(first) + len(reply)] == first + reply  # the generated ids are never re-tokenised
    messages = [*opening, {"role": "assistant", "content": "action 2"}, {"role": "user", "content": "cue: c"}]
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert second == hf.encode(text, add_special_tokens=False)  # and the prompt is the template's own
    cut = t.encode("act")  # cut by max_tokens: the turn is closed for it
    conv.add_turn(cut, [])
    assert conv.prompt()[len(second) :] == [
        *cut,
        *t.encode("<|im_end|>\n"),
        *t.encode("<|im_start|>assistant\n"),
    ]
