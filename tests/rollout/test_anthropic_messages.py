"""MUST-SHOW: the official `anthropic` client, with `tools=` and `stream=True`, drives a multi-turn
tool-calling conversation through `/v1/messages` on the Hugging Face tokenizer path (the project's
tiny Qwen2 checkpoint, fine-tuned as in test_openai_hf_tool_calls.py so that greedy decoding really
emits reasoning and two `<tool_call>` blocks, then an answer; nothing is scripted server-side),
against the real endpoint, torch engine and router, with steps on real NATS and the real trajectory
service storing them in Postgres.

The calls come back as Anthropic `thinking` + `tool_use` blocks with parsed input; the second turn
sends them back with `tool_result` blocks; the stored tokens equal `transformers`' own
`apply_chat_template` of the same conversation in chat form plus the generated ids. Also: the same
turn without streaming (run key as `x-api-key`, execution named by `metadata.user_id`), and on
the byte path every unsupported Messages shape gets a 400 in Anthropic's error body naming its
field, a stop sequence, and 401 without a key.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import transformers

from gyre import rpc, store
from gyre.bus import Bus
from gyre.config import CommonConfig
from gyre.model import ModelConfig
from gyre.model.hf import read_hf_config
from gyre.service import Runtime
from gyre.tokenizers import load_tokenizer
from gyre.v1 import trajectory_pb2, trajectory_pb2_grpc
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.openai import OpenAIEndpoint, create_app, issue_execution_endpoint, serve
from services.rollout.router import Router
from services.rollout.steps import BusStepSink, MemoryStepSink
from services.trajectory.cli import collect_export
from services.trajectory.config import TrajectoryConfig
from services.trajectory.service import TrajectoryService
from tests.helpers.tiny_hf import fine_tune, tiny_qwen2_dir

pytestmark = pytest.mark.integration

MIGRATIONS = Path(__file__).parents[2] / "services" / "trajectory" / "migrations"
RUN = "anthropic-tools"
KEY = "anthropic-run-key-0123456789"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Current weather of a city.", "input_schema": SCHEMA}]
CHAT_TOOLS = [  # the same tools as the chat template gets them
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": SCHEMA,
        },
    }
]
SYSTEM = "You answer questions about the weather."
QUESTION = "What is the weather in Paris and in Rome?"
CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
CALL_IDS = ["call_0_0", "call_1_0"]  # the endpoint's ids of the first turn's parallel calls
REASONING = "Two cities, two calls."
ANSWER = "Paris is sunny and Rome is rainy."
RESULTS = ["sunny, 21 degrees", "rain, 14 degrees"]


def _anthropic_turns(first_content: list[Any]) -> list[dict[str, Any]]:
    """The second turn as the client sends it: the first reply's blocks, then one tool_result each
    (one as a string, one as text blocks)."""
    results = [
        {"type": "tool_result", "tool_use_id": CALL_IDS[0], "content": RESULTS[0]},
        {
            "type": "tool_result",
            "tool_use_id": CALL_IDS[1],
            "content": [{"type": "text", "text": RESULTS[1]}],
        },
    ]
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first_content},
        {"role": "user", "content": results},
    ]


def _chat_conversation(second: bool) -> list[dict[str, Any]]:
    """The same conversation in chat form, written out by hand: what the template must render."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
    ]
    if not second:
        return messages
    calls = [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for cid, (name, args) in zip(CALL_IDS, CALLS, strict=True)
    ]
    messages.append({"role": "assistant", "reasoning_content": REASONING, "tool_calls": calls})
    for cid, (name, _), result in zip(CALL_IDS, CALLS, RESULTS, strict=True):
        messages.append({"role": "tool", "tool_call_id": cid, "name": name, "content": result})
    return messages


def _reference_ids(hf: transformers.PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> list[int]:
    text = hf.apply_chat_template(messages, tools=CHAT_TOOLS, add_generation_prompt=True, tokenize=False)
    return list(hf.encode(text, add_special_tokens=False))


def _targets(hf: transformers.PreTrainedTokenizerBase) -> list[list[int]]:
    """The completions the fine-tuned model emits greedily: reasoning + two calls, then the answer."""
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    blocks = "\n".join(
        f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
        for name, args in CALLS
    )
    first = f"<think>\n{REASONING}\n</think>\n\n" + blocks
    return [[*hf.encode(text, add_special_tokens=False), im_end] for text in (first, ANSWER)]


@pytest.fixture(scope="module")
def trained_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tiny_qwen2_dir()
    hf = transformers.AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    prompts = [_reference_ids(hf, _chat_conversation(second)) for second in (False, True)]
    examples = list(zip(prompts, _targets(hf), strict=True))
    return fine_tune(base, tmp_path_factory.mktemp("anthropic-tools") / "ckpt", examples)


async def _stream_turn(
    client: anthropic.AsyncAnthropic, messages: list[dict[str, Any]]
) -> tuple[Any, list[str]]:
    """One streamed call; returns the accumulated final Message and the event types seen."""
    kinds: list[str] = []
    async with client.messages.stream(
        model="gyre",
        system=SYSTEM,
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=96,
        extra_body={"temperature": 0},  # newer clients have no `temperature` argument
    ) as stream:
        async for event in stream:
            kinds.append(event.type)
        message = await stream.get_final_message()
    return message, kinds


async def _start_trajectory(nats_url: str, database_url: str, ckpt: Path) -> tuple:
    await asyncio.to_thread(store.upgrade, database_url, MIGRATIONS, "alembic_version_trajectory")
    engine = store.create_engine(database_url)
    bus = await Bus.connect(nats_url, name="anthropic-trajectory")
    await bus.ensure_streams()
    server, port = rpc.create_server()
    common = CommonConfig(run_id=RUN, nats_url=nats_url, database_url=database_url)
    cfg = TrajectoryConfig.model_validate(
        {"ready_poll_s": 0.1, "batch_max_wait_s": 0.0, "tokenizer": str(ckpt), "vocab_size": 1088}
    )
    service = TrajectoryService(common, cfg)
    await service.start(
        Runtime(common=common, bus=bus, engine=engine, server=server, port=port, name="trajectory")
    )
    await server.start()
    return service, server, bus, engine, port


async def _exported(port: int, execution_id: str, n: int) -> trajectory_pb2.ExportExecutionResponse:
    channel = rpc.channel(f"127.0.0.1:{port}")
    stub = trajectory_pb2_grpc.TrajectoryStub(channel)
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                exported = await collect_export(stub, execution_id)
                if len(exported.calls) == n:
                    return exported
            except Exception:
                pass
            assert time.monotonic() < deadline, "the trajectory service did not store the calls"
            await asyncio.sleep(0.2)
    finally:
        await channel.close()


@pytest.mark.slow
async def test_anthropic_client_streams_tool_use_and_the_stored_tokens_are_the_template_plus_generated(
    nats_url: str, database_url: str, trained_ckpt: Path
) -> None:
    tokenizer = load_tokenizer(str(trained_ckpt))
    hf = transformers.AutoTokenizer.from_pretrained(str(trained_ckpt), local_files_only=True)
    targets = _targets(hf)
    service, grpc_server, tbus, db, tport = await _start_trajectory(nats_url, database_url, trained_ckpt)
    bus = await Bus.connect(nats_url, name="anthropic-rollout")
    await bus.ensure_streams()
    sink = BusStepSink(bus, max_buffer=64, vocab_size=1088)
    sink.start()
    router = Router()
    engine = TorchEngine("e0", "cpu0-0", read_hf_config(trained_ckpt), init_weights=str(trained_ckpt))
    await engine.start()
    await router.add_engine(engine)
    endpoint = OpenAIEndpoint(
        router, sink, run_id=RUN, tokenizer=tokenizer, vocab_size=1088, max_prompt_tokens=1024, api_key=KEY
    )
    http, port = await serve(create_app(endpoint), "127.0.0.1", 0)
    try:
        base_url, _ = issue_execution_endpoint(endpoint, task_id="weather", execution_id="weather-a0")
        # the per-execution URL alone routes the calls (the client appends /v1/messages)
        client = anthropic.AsyncAnthropic(
            base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0
        )

        first, kinds = await _stream_turn(client, [{"role": "user", "content": QUESTION}])
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
        assert first.stop_reason == "tool_use"
        assert [b.type for b in first.content] == ["thinking", "tool_use", "tool_use"]
        assert first.content[0].thinking == REASONING
        uses = [b for b in first.content if b.type == "tool_use"]
        assert [(b.name, b.input) for b in uses] == CALLS and [b.id for b in uses] == CALL_IDS

        second_messages = _anthropic_turns([b.model_dump(exclude_none=True) for b in first.content])
        second, _ = await _stream_turn(client, second_messages)
        assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"]
        assert second.content[0].text == ANSWER  # type: ignore[union-attr]
        assert second.usage.input_tokens == len(_reference_ids(hf, _chat_conversation(True)))

        # the first turn again, not streamed: the run key as x-api-key, metadata.user_id names it
        plain_client = anthropic.AsyncAnthropic(
            base_url=f"http://127.0.0.1:{port}", api_key=KEY, max_retries=0
        )
        plain = await plain_client.messages.create(
            model="gyre",
            system=SYSTEM,
            messages=[{"role": "user", "content": QUESTION}],
            tools=TOOLS,  # type: ignore[list-item]
            max_tokens=96,
            extra_body={"temperature": 0},
            metadata={"user_id": "weather-a1"},
        )
        assert plain.model_dump(include={"content", "stop_reason", "usage"}) == first.model_dump(
            include={"content", "stop_reason", "usage"}
        )
        assert (plain.model_extra or {})["token_ids"] == targets[0]
        await client.close()
        await plain_client.close()
        async with httpx.AsyncClient() as end:
            r = await end.post(base_url.removesuffix("/v1") + "/gyre/end", json={"reward": 1.0})
            assert r.status_code == 200 and r.json()["num_calls"] == 2
        await sink.flush()

        exported = await _exported(tport, "weather-a0", 2)
        for stored, second_turn, turn, target in zip(
            exported.calls, (False, True), (first, second), targets, strict=True
        ):
            generated = list((turn.model_extra or {})["token_ids"])
            assert generated == target
            assert list(stored.prompt_token_ids) == _reference_ids(hf, _chat_conversation(second_turn))
            assert list(stored.completion_token_ids) == generated
        print(
            "stored calls:",
            [(len(c.prompt_token_ids), len(c.completion_token_ids)) for c in exported.calls],
            "prompt+completion ids equal transformers' apply_chat_template + generated: True",
        )
    finally:
        http.should_exit = True
        await http.gyre_task  # type: ignore[attr-defined]
        for d in list(router.engines):
            await router.remove_engine(d)
        await sink.flush()
        await sink.close()
        await bus.close()
        await service.stop()
        await grpc_server.stop(0)
        await tbus.close()
        db.dispose()


def _body(**overrides: Any) -> dict[str, Any]:
    return {"model": "gyre", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **overrides}


def _user(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(blocks)}]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
UNSUPPORTED_SHAPES = [
    (_body(messages=_user(IMAGE)), "messages[0].content[0].type"),
    (_body(messages=_user({"type": "document", "source": {"type": "text", "data": "x"}})), "messages[0].content[0].type"),
    (_body(messages=_user({"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]})), "messages[0].content[0].content[0].type"),
    (_body(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}, {"role": "user", "content": "go"}]),
     "messages[1].content[0].type"),
    (_body(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]), "messages[-1].role"),
    (_body(system=[{"type": "text", "text": "s"}, IMAGE]), "system[1].type"),
    (_body(top_k=5), "top_k"),
    (_body(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
    (_body(metadata={"user_id": "u", "trace": "x"}), "metadata.trace"),
    (_body(tools=TOOLS, tool_choice={"type": "any"}), "tool_choice"),
    (_body(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}), "tool_choice"),
    (_body(tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": True}), "disable_parallel_tool_use"),
    (_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools"),
    (_body(output_config={"format": {"type": "json_schema", "schema": {}}}), "output_config.format"),
    (_body(mcp_servers=[{"type": "url", "url": "http://x", "name": "m"}]), "mcp_servers"),
    (_body(max_tokens=None), "max_tokens"),
    (_body(temperature=1.5), "temperature"),
    (_body(stop_sequences=[""]), "stop_sequences"),
]  # fmt: skip


async def test_unsupported_shapes_get_400_naming_the_field_and_stop_sequences_are_honoured() -> None:
    sink = MemoryStepSink()
    router = Router()
    engine = TorchEngine("e0", "cpu0-0", ModelConfig.model_validate({}), init_seed=5)
    await engine.start()
    await router.add_engine(engine)
    endpoint = OpenAIEndpoint(router, sink, run_id="anthropic-byte", api_key=KEY)
    server, port = await serve(create_app(endpoint), "127.0.0.1", 0)
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "X-Gyre-Execution-Id": "byte-e0"}
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60
        ) as http:
            for body, field in UNSUPPORTED_SHAPES:
                r = await http.post("/v1/messages", json={k: v for k, v in body.items() if v is not None})
                assert r.status_code == 400, (field, r.text)
                assert r.json()["type"] == "error", r.text
                assert r.json()["error"]["type"] == "invalid_request_error", r.text
                assert field in r.json()["error"]["message"], (field, r.text)
            assert not sink.steps  # nothing refused was generated or stored
            r = await http.post("/v1/messages", json=_body(), headers={"x-api-key": "wrong-key-0123456789"})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            neutral = _body(
                tools=TOOLS,
                tool_choice={"type": "auto"},
                thinking={"type": "disabled"},
                metadata={"user_id": "u1"},
            )
            assert (await http.post("/v1/messages", json=neutral)).status_code == 200
        client = anthropic.AsyncAnthropic(
            base_url=f"http://127.0.0.1:{port}", api_key=KEY, max_retries=0, default_headers=headers
        )
        args: dict[str, Any] = {
            "model": "gyre",
            "max_tokens": 24,
            "extra_body": {"temperature": 0},
            "messages": _body()["messages"],
        }
        full = await client.messages.create(**args)
        text = full.content[0].text  # type: ignore[union-attr]
        stop = text[5:7]
        cut = await client.messages.create(**args, stop_sequences=[stop, "never-there"])
        with pytest.raises(anthropic.BadRequestError, match="top_k"):
            await client.messages.create(**{**args, "extra_body": {"top_k": 3}})
        await client.close()
    finally:
        server.should_exit = True
        await server.gyre_task
        for d in list(router.engines):
            await router.remove_engine(d)
    assert full.stop_reason == ("max_tokens" if full.usage.output_tokens == 24 else "end_turn")
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text.startswith(cut.content[0].text + stop)  # type: ignore[union-attr]
    assert list(sink.steps[-1].completion_token_ids) == (cut.model_extra or {})["token_ids"]
