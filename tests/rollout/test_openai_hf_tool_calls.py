"""MUST-SHOW: the official `openai` client, with `tools=` and `stream=true`, drives a multi-turn
tool-calling conversation through the Hugging Face tokenizer path (the project's tiny Qwen2
checkpoint with its own BPE and Qwen-style chat template) against the real endpoint, torch engine
and router, with steps on real NATS and the real trajectory service storing them in Postgres.

The checkpoint is fine-tuned first (tests/helpers/tiny_hf.py) so that greedy decoding really emits
two parallel `<tool_call>` blocks and then an answer: nothing about the replies is scripted on the
server side. The tool calls come back parsed, and the tokens the trajectory service stores equal
`transformers`' own `apply_chat_template` of the same messages plus the generated ids, token for token.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import transformers

from gyre import rpc, store
from gyre.bus import Bus
from gyre.config import CommonConfig
from gyre.model.hf import read_hf_config
from gyre.service import Runtime
from gyre.tokenizers import load_tokenizer
from gyre.v1 import trajectory_pb2_grpc
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.openai import OpenAIEndpoint, create_app, issue_execution_endpoint, serve
from services.rollout.router import Router
from services.rollout.steps import BusStepSink
from services.trajectory.cli import collect_export
from services.trajectory.config import TrajectoryConfig
from services.trajectory.service import TrajectoryService
from tests.helpers.tiny_hf import fine_tune, tiny_qwen2_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MIGRATIONS = Path(__file__).parents[2] / "services" / "trajectory" / "migrations"
RUN = "hf-tools"
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
USER = {"role": "user", "content": "What is the weather in Paris and in Rome?"}
CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
REASONING = "Two cities, two calls."
ANSWER = "Paris is sunny and Rome is rainy."
RESULTS = ["sunny, 21 degrees", "rain, 14 degrees"]


def _assistant_call_text() -> str:
    blocks = [
        f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
        for name, args in CALLS
    ]
    return f"<think>\n{REASONING}\n</think>\n\n" + "\n".join(blocks)


def _second_turn(call_ids: list[str]) -> list[dict]:
    """The conversation as the client sends it back: the parsed calls, then one tool message each."""
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for cid, (name, args) in zip(call_ids, CALLS, strict=True)
        ],
    }
    tools = [
        {"role": "tool", "tool_call_id": cid, "name": name, "content": result}
        for cid, (name, _), result in zip(call_ids, CALLS, RESULTS, strict=True)
    ]
    return [USER, assistant, *tools]


def _reference_ids(hf: transformers.PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """`transformers`' own rendering of the messages, encoded: what the stored prompt must equal."""
    clean = [{k: v for k, v in m.items() if v is not None} for m in messages]
    text = hf.apply_chat_template(clean, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    return list(hf.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def trained_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tiny_qwen2_dir()
    hf = transformers.AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    # the ids the endpoint will issue to the calls of the first turn (parallel calls of call_seq 0)
    call_ids = [f"call_{n}_0" for n in range(len(CALLS))]
    examples = [
        (_reference_ids(hf, [USER]), [*hf.encode(_assistant_call_text(), add_special_tokens=False), im_end]),
        (_reference_ids(hf, _second_turn(call_ids)), [*hf.encode(ANSWER, add_special_tokens=False), im_end]),
    ]
    return fine_tune(base, tmp_path_factory.mktemp("tools") / "ckpt", examples)


async def _stream_turn(client: openai.AsyncOpenAI, messages: list[dict]) -> dict:
    """One streamed call; returns content, reasoning, tool calls (accumulated from deltas) and extras."""
    stream = await client.chat.completions.create(
        model="gyre",
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        max_tokens=96,
    )
    out: dict = {"content": "", "reasoning": "", "calls": {}, "extras": {}, "usage": None, "finish": None}
    async for chunk in stream:
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                slot = out["calls"].setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                slot["name"] += call.function.name or "" if call.function else ""
                slot["arguments"] += call.function.arguments or "" if call.function else ""
            if choice.finish_reason:
                out["finish"] = choice.finish_reason
                out["extras"] = choice.model_extra or {}
    return out


async def _start_trajectory(nats_url: str, database_url: str, ckpt: Path) -> tuple:
    await asyncio.to_thread(store.upgrade, database_url, MIGRATIONS, "alembic_version_trajectory")
    engine = store.create_engine(database_url)
    bus = await Bus.connect(nats_url, name="hf-tools-trajectory")
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


async def test_openai_client_streams_parallel_tool_calls_and_the_stored_tokens_are_the_template_plus_generated(
    nats_url: str, database_url: str, trained_ckpt: Path
) -> None:
    tokenizer = load_tokenizer(str(trained_ckpt))
    hf = transformers.AutoTokenizer.from_pretrained(str(trained_ckpt), local_files_only=True)
    service, grpc_server, tbus, db, tport = await _start_trajectory(nats_url, database_url, trained_ckpt)
    bus = await Bus.connect(nats_url, name="hf-tools-rollout")
    await bus.ensure_streams()
    sink = BusStepSink(bus, max_buffer=64, vocab_size=1088)
    sink.start()
    router = Router()
    engine = TorchEngine("e0", "cpu0-0", read_hf_config(trained_ckpt), init_weights=str(trained_ckpt))
    await engine.start()
    await router.add_engine(engine)
    endpoint = OpenAIEndpoint(
        router,
        sink,
        run_id=RUN,
        tokenizer=tokenizer,
        vocab_size=1088,
        max_prompt_tokens=1024,
        api_key="k" * 24,
    )
    http, _ = await serve(create_app(endpoint), "127.0.0.1", 0)
    try:
        base_url, key = issue_execution_endpoint(endpoint, task_id="weather", execution_id="weather-e0")
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)

        first = await _stream_turn(client, [USER])
        calls = [first["calls"][i] for i in sorted(first["calls"])]
        assert first["finish"] == "tool_calls" and first["reasoning"] == REASONING
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == CALLS
        assert [c["id"] for c in calls] == ["call_0_0", "call_1_0"]

        second_messages = _second_turn([c["id"] for c in calls])
        second = await _stream_turn(client, second_messages)
        assert second["finish"] == "stop" and second["content"] == ANSWER and not second["calls"]
        assert second["usage"].prompt_tokens == len(_reference_ids(hf, second_messages))
        async with httpx.AsyncClient() as end:
            r = await end.post(base_url.removesuffix("/v1") + "/gyre/end", json={"reward": 1.0})
            assert r.status_code == 200 and r.json()["num_calls"] == 2
        await sink.flush()

        channel = rpc.channel(f"127.0.0.1:{tport}")
        stub = trajectory_pb2_grpc.TrajectoryStub(channel)
        deadline = time.monotonic() + 60
        while True:
            try:
                exported = await collect_export(stub, "weather-e0")
                if len(exported.calls) == 2:
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline, "the trajectory service did not store both calls"
            await asyncio.sleep(0.2)
        await channel.close()
        for stored, messages, turn in zip(
            exported.calls, [[USER], second_messages], [first, second], strict=True
        ):
            generated = list(turn["extras"]["token_ids"])
            assert list(stored.prompt_token_ids) == _reference_ids(hf, messages)
            assert list(stored.completion_token_ids) == generated
            assert generated[-1] == hf.convert_tokens_to_ids("<|im_end|>")
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
