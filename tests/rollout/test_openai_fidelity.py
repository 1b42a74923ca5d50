"""OpenAI endpoint fidelity on the byte path (real endpoint, torch engine, router, steps on real
NATS): every request shape the endpoint does not honour gets a 400 naming the field; `n>1` makes
one step per sample; `stop` strings cut the completion before its step is published; `max_tokens`
defaults to the context left; `logprobs`; `tool_choice: none`; `stream=true` on completions."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from gyre.bus import Bus, subjects
from gyre.model import ModelConfig
from gyre.tokenizers import load_tokenizer
from gyre.v1 import events_pb2
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.openai import OpenAIEndpoint, create_app, serve
from services.rollout.router import Router
from services.rollout.steps import BusStepSink
from tests.helpers.stream import expanded_prompts

pytestmark = pytest.mark.integration

RUN = "openai-fidelity"
KEY = "fidelity-key-0123456789"
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]


class Stack:
    """The endpoint on a real engine and router; steps go to NATS through the real sink."""

    async def start(self, nats_url: str, **options: int) -> Stack:
        self.bus = await Bus.connect(nats_url, name="fidelity-test")
        await self.bus.ensure_streams()
        self.sink = BusStepSink(self.bus, max_buffer=64, batch_size=8)
        self.sink.start()
        self.router = Router()
        engine = TorchEngine("e0", "cpu0-0", ModelConfig.model_validate({}), init_seed=5)
        await engine.start()
        await self.router.add_engine(engine)
        self.endpoint = OpenAIEndpoint(self.router, self.sink, run_id=RUN, api_key=KEY, **options)
        self.server, port = await serve(create_app(self.endpoint), "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def http(self, execution: str) -> httpx.AsyncClient:
        headers = {
            "Authorization": f"Bearer {KEY}",
            "X-Gyre-Execution-Id": execution,
            "X-Gyre-Task-Id": "fid",
        }
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=60)

    async def steps(self, n: int, execution: str) -> list[events_pb2.StepEvent]:
        await self.sink.flush()
        got: list[events_pb2.StepEvent] = []

        async def collect() -> None:
            async for ev in self.bus.tail(subjects.steps(RUN, "fid"), events_pb2.StepEvent, from_start=True):
                if ev.execution_id == execution:
                    got.append(ev)
                if len(got) == n:
                    return

        await asyncio.wait_for(collect(), 20)
        return got

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.server.gyre_task
        for d in list(self.router.engines):
            await self.router.remove_engine(d)
        await self.sink.flush()
        await self.sink.close()
        await self.bus.close()


def chat(**overrides: object) -> dict:
    return {"model": "gyre", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **overrides}


UNSUPPORTED_SHAPES = [
    ("/v1/chat/completions", chat(tool_choice="required", tools=TOOLS), "tool_choice"),
    ("/v1/chat/completions", chat(tool_choice={"type": "function", "function": {"name": "run"}}, tools=TOOLS), "tool_choice"),
    ("/v1/chat/completions", chat(parallel_tool_calls=False, tools=TOOLS), "parallel_tool_calls"),
    ("/v1/chat/completions", chat(response_format={"type": "json_object"}), "response_format"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {}}), "response_format"),
    ("/v1/chat/completions", chat(logit_bias={"5": 10}), "logit_bias"),
    ("/v1/chat/completions", chat(presence_penalty=0.5), "presence_penalty"),
    ("/v1/chat/completions", chat(frequency_penalty=-1), "frequency_penalty"),
    ("/v1/chat/completions", chat(top_logprobs=3, logprobs=True), "top_logprobs"),
    ("/v1/chat/completions", chat(functions=[{"name": "f"}]), "functions"),
    ("/v1/chat/completions", chat(function_call="auto"), "function_call"),
    ("/v1/chat/completions", chat(modalities=["text", "audio"]), "modalities"),
    ("/v1/chat/completions", chat(audio={"voice": "x"}), "audio"),
    ("/v1/chat/completions", chat(prediction={"type": "content", "content": "x"}), "prediction"),
    ("/v1/chat/completions", chat(n=17), "n"),
    ("/v1/chat/completions", chat(stop=[""]), "stop"),
    ("/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0].type"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 5}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
]  # fmt: skip


async def test_every_unsupported_request_shape_gets_400_naming_its_field(nats_url: str) -> None:
    stack = await Stack().start(nats_url)
    try:
        async with stack.http("unsupported-e0") as http:
            for path, body, field in UNSUPPORTED_SHAPES:
                r = await http.post(path, json=body)
                assert r.status_code == 400, (field, r.text)
                assert field in r.json()["error"]["message"], (field, r.text)
            neutral = chat(
                tool_choice="auto", tools=TOOLS, presence_penalty=0, response_format={"type": "text"}
            )
            assert (await http.post("/v1/chat/completions", json=neutral)).status_code == 200
    finally:
        await stack.stop()


async def test_n_samples_are_each_their_own_step_with_their_own_seed(nats_url: str) -> None:
    stack = await Stack().start(nats_url)
    try:
        async with stack.http("n-e0") as http:
            r = await http.post(
                "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 12, "n": 3, "temperature": 1.0}
            )
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        steps = await stack.steps(3, "n-e0")
    finally:
        await stack.stop()
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert sorted(s.call_seq for s in steps) == [0, 1, 2]
    by_tokens = {tuple(s.completion_token_ids): s for s in steps}
    assert len(by_tokens) == 3  # three different samples
    prompts = expanded_prompts(steps)  # later samples travel as references to the first call
    for c in choices:
        assert prompts[by_tokens[tuple(c["token_ids"])].call_seq] == [1, 2, 3]
    assert r.json()["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)


async def test_a_stop_string_cuts_the_completion_and_its_step(nats_url: str) -> None:
    stack = await Stack().start(nats_url)
    body = {"prompt": "The answer is", "max_tokens": 24, "temperature": 0, "stop_token_ids": []}
    try:
        async with stack.http("stop-e0") as http:
            full = (await http.post("/v1/completions", json=body)).json()["choices"][0]
            text = full["text"]
            stop = text[5:7]
            cut = (await http.post("/v1/completions", json={**body, "stop": [stop, "never-there"]})).json()[
                "choices"
            ][0]
        steps = await stack.steps(2, "stop-e0")
    finally:
        await stack.stop()
    assert len(full["token_ids"]) == 24 and full["finish_reason"] == "length"
    assert stop not in cut["text"] and text.startswith(cut["text"] + stop)
    assert cut["finish_reason"] == "stop"
    assert cut["token_ids"] == full["token_ids"][: len(cut["token_ids"])] and len(cut["token_ids"]) < 24
    stored = next(s for s in steps if s.call_seq == 1)
    assert list(stored.completion_token_ids) == cut["token_ids"]
    assert len(stored.completion_logprobs) == len(cut["token_ids"])


async def test_max_tokens_defaults_to_the_context_left_after_the_prompt(nats_url: str) -> None:
    stack = await Stack().start(nats_url, max_prompt_tokens=40)
    try:
        async with stack.http("ctx-e0") as http:
            r = await http.post("/v1/completions", json={"prompt": list(range(10)), "stop_token_ids": []})
            too_long = await http.post("/v1/completions", json={"prompt": list(range(10)), "max_tokens": 31})
    finally:
        await stack.stop()
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 30
    assert too_long.status_code == 400 and "max_tokens 31" in too_long.json()["error"]["message"]


async def test_chat_logprobs_and_tool_choice_none(nats_url: str) -> None:
    stack = await Stack().start(nats_url)
    byte = load_tokenizer("byte")
    messages = [{"role": "user", "content": "hi"}]
    try:
        async with stack.http("lp-e0") as http:
            r = (await http.post("/v1/chat/completions", json=chat(logprobs=True, max_tokens=6))).json()
            none = (
                await http.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice="none"))
            ).json()
            auto = (await http.post("/v1/chat/completions", json=chat(tools=TOOLS))).json()
    finally:
        await stack.stop()
    choice = r["choices"][0]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == choice["token_logprobs"]
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert none["prompt_token_ids"] == byte.apply_chat_template(messages)  # tools not rendered
    assert auto["prompt_token_ids"] == byte.apply_chat_template(messages, tools=TOOLS)
    assert auto["prompt_token_ids"] != none["prompt_token_ids"]


async def test_streamed_completions_tell_the_same_text_and_end_with_usage(nats_url: str) -> None:
    stack = await Stack().start(nats_url)
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=KEY, max_retries=0)
    args = {"model": "gyre", "prompt": "count:", "max_tokens": 10, "temperature": 0, "user": "stream-e0"}
    try:
        plain = await client.completions.create(**args)  # type: ignore[call-overload]
        stream = await client.completions.create(  # type: ignore[call-overload]
            **args, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    finally:
        await client.close()
        await stack.stop()
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text and len(chunks) > 2
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [plain.choices[0].finish_reason]
