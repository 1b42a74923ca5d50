"""Property: whatever the model writes, the tool calls Gyre returns are complete, the stop reason is
right, and the client can send the reply back verbatim, on both APIs and both tokenizers.

Generated model outputs (hypothesis): text, raw bytes, reasoning blocks (terminated or not), tool
calls that are well-formed (arguments as nested JSON objects), nameless, empty-named, named with
spaces, with arguments that are not a JSON object, garbage, or cut anywhere, stray special tokens,
with or without a stop token, under a `max_tokens` that may cut the turn anywhere. For each output
and each API (`/v1/chat/completions`, `/v1/messages`):

- no call with an empty name, every call's arguments a JSON object; `finish_reason` `length` /
  `stop_reason` `max_tokens` exactly when the engine hit `max_tokens`, `tool_calls` / `tool_use`
  only with calls;
- an output made only of well-formed calls and a stop token comes back as exactly those calls;
- the reply, sent back verbatim with a result for every call, is accepted (200);
- the stored step's completion ids are exactly what the engine produced, and its prompt ids those
  the response reports.

Runs the real endpoint app (in process, through httpx's ASGI transport), the real router and the
real in-memory step sink. The only fake is the outermost edge: the model. `ScriptedEngine` is an
engine whose "model" writes the generated output, honouring `max_tokens` and stop ids as the engine
contract says; nothing in the endpoint is bypassed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre import tokenizer as byte_tokens
from gyre.tokenizers import Tokenizer, load_tokenizer
from gyre.v1 import common_pb2
from services.rollout.engines.base import Completion, Engine, EngineState, GenerationRequest
from services.rollout.openai import OpenAIEndpoint, create_app
from services.rollout.router import Router
from services.rollout.steps import MemoryStepSink

SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "run", "parameters": SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "run", "description": "Run a command.", "input_schema": SCHEMA}]
NUM_EXAMPLES = 150


class ScriptedEngine(Engine):
    """The model, faked: answers each request of an execution with the next scripted output, cut
    after its first stop id (finish "stop") or at `max_tokens` (finish "length")."""

    engine_id, device_id = "scripted", "cpu0-0"

    def __init__(self) -> None:
        self.scripts: dict[str, list[list[int]]] = {}
        self.produced: dict[str, list[list[int]]] = {}
        self.reasons: dict[str, list[str]] = {}

    @property
    def state(self) -> EngineState:
        return EngineState.SERVING

    @property
    def weight_version(self) -> int:
        return 0

    @property
    def num_active(self) -> int:
        return 0

    async def start(self) -> None:
        pass

    async def generate(self, request: GenerationRequest) -> Completion:
        script = self.scripts[request.execution_id].pop(0)
        stops = set(request.sampling.stop_token_ids)
        end = next((n + 1 for n, t in enumerate(script) if t in stops), None)
        limit = request.sampling.max_tokens
        ids, reason = (
            (script[:end], "stop") if end is not None and end <= limit else (script[:limit], "length")
        )
        self.produced.setdefault(request.execution_id, []).append(ids)
        self.reasons.setdefault(request.execution_id, []).append(reason)
        n = len(ids)
        return Completion(ids, [-1.0] * n, [0] * n, reason, [self.engine_id])

    async def load_weights(self, weights: common_pb2.WeightVersion) -> None:
        pass

    async def drain(self) -> None:
        pass

    async def close(self) -> None:
        pass


# -- what the model writes -----------------------------------------------------------------------
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
ARGUMENTS = st.dictionaries(TEXT, JSON_VALUES, max_size=3)
NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)


@st.composite
def good_call(draw: st.DrawFn) -> tuple[str, dict[str, Any], str]:
    """(name, arguments, payload as the model writes it), arguments a nested JSON object."""
    name, args = draw(NAMES), draw(ARGUMENTS)
    as_text = draw(st.booleans())  # the byte template writes arguments as JSON text; Hermes as an object
    payload = json.dumps({"name": name, "arguments": json.dumps(args) if as_text else args})
    return name, args, payload


BAD_PAYLOADS = st.one_of(
    ARGUMENTS.map(lambda a: json.dumps({"arguments": a})),  # no name
    ARGUMENTS.map(lambda a: json.dumps({"name": "", "arguments": a})),  # empty name
    ARGUMENTS.map(lambda a: json.dumps({"name": "run it", "arguments": a})),  # whitespace in the name
    JSON_VALUES.filter(lambda v: not isinstance(v, dict)).map(
        lambda v: json.dumps({"name": "run", "arguments": v})  # arguments not an object
    ),
    TEXT.map(lambda t: json.dumps({"name": "run", "arguments": t})),  # arguments text, not JSON
    TEXT,  # garbage
    st.tuples(good_call(), st.integers(0, 200)).map(lambda g: g[0][2][: g[1]]),  # cut anywhere
)


class Writer:
    """Turns pieces of a model output into one tokenizer's ids (markers as that tokenizer has them)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte = tokenizer.spec == "byte"
        self.stop = tokenizer.stop_ids[0]

    def text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def think(self, text: str, closed: bool) -> list[int]:
        if self.byte:
            return [byte_tokens.THINK_OPEN, *self.text(text), *([byte_tokens.THINK_CLOSE] if closed else [])]
        return self.text(f"<think>\n{text}\n" + ("</think>\n\n" if closed else ""))

    def call(self, payload: str, closed: bool) -> list[int]:
        if self.byte:
            close = [byte_tokens.TOOL_CALL_CLOSE] if closed else []
            return [byte_tokens.TOOL_CALL_OPEN, *self.text(payload), *close]
        return self.text(f"<tool_call>\n{payload}\n" + ("</tool_call>" if closed else ""))

    def specials(self) -> list[int]:
        if self.byte:
            return [byte_tokens.PAD, byte_tokens.BOS, byte_tokens.USER, byte_tokens.TOOL, 300, 511]
        return [self.stop]


def outputs(writer: Writer) -> st.SearchStrategy[tuple[list[int], int, list[tuple[str, dict[str, Any]]]]]:
    """(model output ids, max_tokens, the calls it must come back as: [] unless well-formed)."""
    piece = st.one_of(
        TEXT.map(writer.text),
        st.binary(max_size=6).map(list) if writer.byte else TEXT.map(writer.text),
        st.tuples(TEXT, st.booleans()).map(lambda t: writer.think(*t)),
        st.tuples(good_call(), st.booleans()).map(lambda t: writer.call(t[0][2], t[1])),
        st.tuples(BAD_PAYLOADS, st.booleans()).map(lambda t: writer.call(*t)),
        st.sampled_from(writer.specials()).map(lambda t: [t]),
    )

    @st.composite
    def messy(draw: st.DrawFn) -> tuple[list[int], int, list[tuple[str, dict[str, Any]]]]:
        ids = list(itertools.chain.from_iterable(draw(st.lists(piece, min_size=1, max_size=5))))
        if draw(st.booleans()):
            ids.append(writer.stop)
        return ids, draw(st.integers(1, len(ids) + 4)), []

    @st.composite
    def well_formed(draw: st.DrawFn) -> tuple[list[int], int, list[tuple[str, dict[str, Any]]]]:
        calls = draw(st.lists(good_call(), min_size=1, max_size=3))
        ids = writer.think(draw(TEXT), True) if draw(st.booleans()) else []
        for _, _, payload in calls:
            ids += writer.call(payload, True) + (writer.text("\n") if not writer.byte else [])
        ids.append(writer.stop)
        return ids, len(ids) + draw(st.integers(0, 4)), [(name, args) for name, args, _ in calls]

    return st.one_of(messy(), well_formed())


# -- the checks ----------------------------------------------------------------------------------
class Harness:
    """The endpoint app in process on one event loop, with the scripted engine behind the router."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = ScriptedEngine()
        self.sink = MemoryStepSink()
        self.router = Router()
        self.loop.run_until_complete(self.router.add_engine(self.engine))
        self.endpoint = OpenAIEndpoint(self.router, self.sink, run_id="roundtrip", tokenizer=tokenizer)
        transport = httpx.ASGITransport(app=create_app(self.endpoint))
        self.http = httpx.AsyncClient(transport=transport, base_url="http://gyre", timeout=30)
        self.executions = itertools.count()
        self.num_cases: dict[str, int] = {"chat": 0, "messages": 0}

    def close(self) -> None:
        self.loop.run_until_complete(self.http.aclose())
        self.loop.close()

    def post(self, execution: str, path: str, body: dict[str, Any]) -> httpx.Response:
        headers = {"X-Gyre-Execution-Id": execution, "anthropic-version": "2023-06-01"}
        return self.loop.run_until_complete(self.http.post(path, json=body, headers=headers))

    def run(
        self, api: str, output: list[int], max_tokens: int, expected: list[tuple[str, dict[str, Any]]]
    ) -> None:
        execution = f"{api}-{next(self.executions)}"
        self.engine.scripts[execution] = [output, [self.engine_stop]]
        self.num_cases[api] += 1
        first = (chat_turn if api == "chat" else messages_turn)(self, execution, max_tokens)
        produced = self.engine.produced[execution]
        assert first.length == (self.engine.reasons[execution][0] == "length")
        if expected:
            assert not first.length and first.calls == expected, (first.calls, expected)
        # what the engine produced is what the response says and what was stored, id for id
        step = [s for s in self.sink.steps if s.execution_id == execution]
        assert len(step) == 2
        assert list(step[0].completion_token_ids) == produced[0] == first.token_ids
        assert list(step[0].prompt_token_ids) == first.prompt_ids
        assert list(step[1].completion_token_ids) == produced[1]

    @property
    def engine_stop(self) -> int:
        return self.endpoint.tokenizer.stop_ids[0]


class Turn:
    def __init__(self, calls: list[tuple[str, dict[str, Any]]], length: bool, body: dict[str, Any]) -> None:
        self.calls, self.length = calls, length
        self.token_ids, self.prompt_ids = body["token_ids"], body["prompt_token_ids"]


def chat_turn(h: Harness, execution: str, max_tokens: int) -> Turn:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    body = {"messages": messages, "tools": CHAT_TOOLS, "max_tokens": max_tokens}
    r = h.post(execution, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message, reason = choice["message"], choice["finish_reason"]
    calls = message.get("tool_calls") or []
    for call in calls:
        assert call["function"]["name"] and isinstance(json.loads(call["function"]["arguments"]), dict)
    assert reason in ("stop", "length", "tool_calls") and (reason == "tool_calls") == bool(calls)
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in calls]
    again = {**body, "messages": [*messages, message, *results, {"role": "user", "content": "next"}]}
    r2 = h.post(execution, "/v1/chat/completions", again)
    assert r2.status_code == 200, r2.text  # the reply, verbatim, is accepted back
    parsed = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    return Turn(parsed, reason == "length", choice)


def messages_turn(h: Harness, execution: str, max_tokens: int) -> Turn:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    body = {"model": "gyre", "messages": messages, "tools": ANTHROPIC_TOOLS, "max_tokens": max_tokens}
    r = h.post(execution, "/v1/messages", body)
    assert r.status_code == 200, r.text
    message = r.json()
    uses = [b for b in message["content"] if b["type"] == "tool_use"]
    for block in uses:
        assert block["name"] and block["id"] and isinstance(block["input"], dict)
    reason = message["stop_reason"]
    assert reason in ("end_turn", "max_tokens", "tool_use") and (reason == "tool_use") == bool(uses)
    reply = {"role": "assistant", "content": message["content"]}
    results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "ok"} for b in uses]
    after = {"role": "user", "content": [*results, {"type": "text", "text": "next"}]}
    r2 = h.post(execution, "/v1/messages", {**body, "messages": [*messages, reply, after]})
    assert r2.status_code == 200, r2.text  # the reply, verbatim, is accepted back
    return Turn([(b["name"], b["input"]) for b in uses], reason == "max_tokens", message)


def _hf_tokenizer() -> Tokenizer:
    from tests.helpers.tiny_hf import tiny_qwen2_dir

    return load_tokenizer(str(tiny_qwen2_dir()))


TOKENIZERS: dict[str, Callable[[], Tokenizer]] = {"byte": lambda: load_tokenizer("byte"), "hf": _hf_tokenizer}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    h = Harness(TOKENIZERS[request.param]())
    yield h
    h.close()
    print(f"\n{request.param} tokenizer: generated model outputs checked per API: {h.num_cases}")


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_any_model_output_comes_back_as_complete_calls_or_text_and_is_accepted_back(
    harness: Harness, api: str
) -> None:
    writer = Writer(harness.endpoint.tokenizer)

    @settings(max_examples=NUM_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(outputs(writer))
    def check(case: tuple[list[int], int, list[tuple[str, dict[str, Any]]]]) -> None:
        harness.run(api, *case)

    check()


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_call_cut_by_max_tokens_comes_back_as_its_text_with_the_length_stop_reason(
    harness: Harness, api: str
) -> None:
    writer = Writer(harness.endpoint.tokenizer)
    payload = json.dumps({"name": "run", "arguments": {"cmd": "ls -la"}})
    output = writer.text("Listing. ") + writer.call(payload, True) + [writer.stop]
    cut = len(output) - 6  # inside the JSON
    execution = f"cut-{api}-{next(harness.executions)}"
    harness.engine.scripts[execution] = [output, [writer.stop]]
    messages = [{"role": "user", "content": "go"}]
    if api == "chat":
        body = {"messages": messages, "tools": CHAT_TOOLS, "max_tokens": cut}
        choice = harness.post(execution, "/v1/chat/completions", body).json()["choices"][0]
        text, reason, calls = (
            choice["message"]["content"],
            choice["finish_reason"],
            choice["message"].get("tool_calls"),
        )
        assert reason == "length" and not calls
    else:
        body = {"model": "gyre", "messages": messages, "tools": ANTHROPIC_TOOLS, "max_tokens": cut}
        message = harness.post(execution, "/v1/messages", body).json()
        assert message["stop_reason"] == "max_tokens"
        assert [b["type"] for b in message["content"]] == ["text"]
        text = message["content"][0]["text"]
    written = harness.endpoint.tokenizer.decode(output[:cut])
    assert text == written  # the text as the model wrote it (HF: markers included; byte: specials dropped)
    assert text.startswith("Listing. ") and '{"name": "run", "arguments": {"cmd": "ls' in text
