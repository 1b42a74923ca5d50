"""The OpenAI-compatible endpoint, driven by the official `openai` client, with steps on real NATS;
and the vLLM engine's HTTP protocol, exercised against this same endpoint (no real vLLM here)."""

import asyncio
import json

import openai
import pytest

from gyre import tokenizer as tok
from gyre.bus import Bus, subjects
from gyre.model import ModelConfig
from gyre.v1 import events_pb2
from services.rollout.engines.base import GenerationRequest, Sampling
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.openai_api import OpenAIEndpoint, create_app, serve
from services.rollout.router import Router
from services.rollout.steps import BusStepSink

RUN = "openai-test"


async def start_stack(nats_url: str) -> tuple[Bus, BusStepSink, Router, OpenAIEndpoint, object, int]:
    bus = await Bus.connect(nats_url, name="rollout-openai-test")
    await bus.ensure_streams()
    sink = BusStepSink(bus, max_buffer=64, batch_size=8)
    sink.start()
    router = Router()
    engine = TorchEngine("e0", "cpu0-0", ModelConfig.model_validate({}), init_seed=3)
    await engine.start()
    await router.add_engine(engine)
    endpoint = OpenAIEndpoint(router, sink, run_id=RUN)
    server, port = await serve(create_app(endpoint), "127.0.0.1", 0)
    return bus, sink, router, endpoint, server, port


async def stop_stack(bus: Bus, sink: BusStepSink, router: Router, server: object) -> None:
    server.should_exit = True  # type: ignore[attr-defined]
    await server.gyre_task  # type: ignore[attr-defined]
    for d in list(router.engines):
        await router.remove_engine(d)
    await sink.close()
    await bus.close()


async def test_openai_client_drives_a_multi_turn_execution_and_its_steps_arrive(nats_url: str) -> None:
    bus, sink, router, endpoint, server, port = await start_stack(nats_url)
    received: list[events_pb2.StepEvent] = []

    async def collect() -> None:
        async for ev in bus.tail(subjects.steps(RUN, "t-chat"), events_pb2.StepEvent):
            received.append(ev)
            if len(received) == 3:
                return

    collector = asyncio.create_task(collect())
    await asyncio.sleep(0.2)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
    messages: list[dict] = [{"role": "user", "content": "hello"}]
    responses = []
    try:
        for turn in range(3):
            resp = await client.chat.completions.create(
                model="gyre",
                messages=messages,  # type: ignore[arg-type]
                tools=tools,  # type: ignore[arg-type]
                max_tokens=8,
                temperature=0.7,
                extra_headers={"X-Gyre-Execution-Id": "chat-e0", "X-Gyre-Task-Id": "t-chat"},
            )
            responses.append(resp)
            messages += [{"role": "assistant", "content": resp.choices[0].message.content or ""}]
            messages += [{"role": "user", "content": f"turn {turn}"}]
        await sink.flush()
        await asyncio.wait_for(collector, 20)
        await client.close()
    finally:
        await stop_stack(bus, sink, router, server)

    assert sorted(s.call_seq for s in received) == [0, 1, 2]
    assert {s.execution_id for s in received} == {"chat-e0"}
    for resp in responses:
        extra = resp.model_extra or {}
        step = next(s for s in received if list(s.completion_token_ids) == extra["token_ids"])
        assert list(step.prompt_token_ids) == extra["prompt_token_ids"]  # captured server-side
        assert (
            len(step.completion_logprobs) == len(step.completion_versions) == len(step.completion_token_ids)
        )
    assert len(received[2].prompt_token_ids) > len(received[0].prompt_token_ids)


async def test_completions_take_token_ids_and_return_logprobs(nats_url: str) -> None:
    bus, sink, router, endpoint, server, port = await start_stack(nats_url)
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        prompt = [tok.BOS, *tok.encode("abc"), tok.ASSISTANT]
        resp = await client.completions.create(model="gyre", prompt=prompt, max_tokens=5, temperature=0, logprobs=1,
                                               extra_body={"stop_token_ids": []}, user="cmp-e0")  # fmt: skip
        choice = resp.choices[0]
        extra = choice.model_extra or {}
        direct = await router.generate(
            GenerationRequest("x", prompt, Sampling(max_tokens=5, stop_token_ids=()))
        )
        assert extra["token_ids"] == direct.token_ids and extra["prompt_token_ids"] == prompt
        assert choice.logprobs is not None and len(choice.logprobs.token_logprobs or []) == 5
        with pytest.raises(openai.BadRequestError, match="token ids"):
            await client.with_options(max_retries=0).completions.create(
                model="gyre", prompt=[9999], max_tokens=2
            )
        await client.close()
    finally:
        await stop_stack(bus, sink, router, server)


def test_tool_call_payload_is_parsed_into_openai_tool_calls() -> None:
    ids = [
        tok.TOOL_CALL_OPEN,
        *tok.encode(json.dumps({"name": "run", "arguments": "{}"})),
        tok.TOOL_CALL_CLOSE,
    ]
    turn = tok.parse_assistant(ids)
    assert turn.tool_calls[0].name == "run"


async def test_vllm_engine_protocol_against_gyres_own_endpoint(nats_url: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Not a real vLLM: the VLLMEngine client talks to Gyre's endpoint, which implements the same routes."""
    from services.rollout.engines.vllm_engine import VLLMEngine
    from services.rollout.weights import WeightSwapper
    from tests.rollout.test_weights import weights_file

    bus, sink, router, endpoint, server, port = await start_stack(nats_url)
    endpoint.weights_loader = WeightSwapper(router).apply
    remote = VLLMEngine("vllm0", "gpu0-0", f"http://127.0.0.1:{port}")
    await remote.start()
    try:
        request = GenerationRequest(
            "v", [tok.BOS, *tok.encode("hi"), tok.ASSISTANT], Sampling(max_tokens=6, stop_token_ids=())
        )
        via_http = await remote.generate(request)
        direct = await router.generate(request)
        assert via_http.token_ids == direct.token_ids and via_http.logprobs == pytest.approx(
            direct.logprobs, abs=1e-5
        )
        await remote.sleep()
        assert await remote.is_sleeping()
        await remote.wake_up()
        assert not await remote.is_sleeping()
        await remote.load_weights(weights_file(tmp_path, 1))
        assert remote.weight_version == 1 and router.engines["cpu0-0"].weight_version == 1
        after = await remote.generate(request)
        assert after.versions == [1] * 6
        pending = asyncio.create_task(
            remote.generate(
                GenerationRequest("long", request.prompt_ids, Sampling(max_tokens=2000, stop_token_ids=()))
            )
        )
        await asyncio.sleep(0.2)
        await remote.drain()
        assert (await pending).finish_reason == "cut"
    finally:
        await remote.close()
        await stop_stack(bus, sink, router, server)
