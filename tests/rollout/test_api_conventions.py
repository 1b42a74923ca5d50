"""The endpoint keeps each API's conventions (real endpoint, torch engine and router on the byte
path; steps kept by the in-memory sink): a streamed completion ends with a usage chunk only when
`stream_options.include_usage` asks for it; `POST /v1/messages/count_tokens` counts exactly the
prompt `/v1/messages` renders; every error, an unknown route included, comes in the API's own
shape (OpenAI's `{"error": {...}}`, Anthropic's `{"type": "error", "error": {...}}` on
`/v1/messages*`), so each official client raises its own typed error."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gyre.model import ModelConfig
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.openai import OpenAIEndpoint, create_app, serve
from services.rollout.router import Router
from services.rollout.steps import MemoryStepSink

pytestmark = pytest.mark.integration

KEY = "conventions-key-0123456789"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture
async def url() -> AsyncIterator[str]:
    router = Router()
    engine = TorchEngine("e0", "cpu0-0", ModelConfig.model_validate({}), init_seed=5)
    await engine.start()
    await router.add_engine(engine)
    endpoint = OpenAIEndpoint(router, MemoryStepSink(), run_id="conventions", api_key=KEY)
    server, port = await serve(create_app(endpoint), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await server.gyre_task
        for d in list(router.engines):
            await router.remove_engine(d)


def _openai(url: str, execution: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=url + "/v1", api_key=KEY, max_retries=0, default_headers={"X-Gyre-Execution-Id": execution}
    )


async def test_a_stream_ends_with_a_usage_chunk_only_when_include_usage_asks(url: str) -> None:
    client = _openai(url, "stream-e0")
    chat: dict[str, Any] = {
        "model": "gyre",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "n": 2,
    }
    completion: dict[str, Any] = {"model": "gyre", "prompt": "count:", "max_tokens": 6, "temperature": 0}
    try:
        plain_chat = await client.chat.completions.create(**chat)
        plain_completion = await client.completions.create(**completion)
        streams: dict[str, list[Any]] = {}
        for usage in (False, True):
            options = {"stream_options": {"include_usage": True}} if usage else {}
            chunks = await client.chat.completions.create(**chat, stream=True, **options)
            streams[f"chat/{usage}"] = [c async for c in chunks]
            chunks = await client.completions.create(**completion, stream=True, **options)
            streams[f"completion/{usage}"] = [c async for c in chunks]
    finally:
        await client.close()
    for name, chunks in streams.items():
        with_usage = name.endswith("True")
        body = chunks[:-1] if with_usage else chunks
        # the loop most clients write: every chunk but the usage chunk has a choice
        assert all(c.choices and c.choices[0].index in (0, 1) for c in body), name
        assert all(c.usage is None for c in body), name
        if with_usage:
            plain = plain_chat if name.startswith("chat") else plain_completion
            assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage, name
    text = "".join(c.choices[0].delta.content or "" for c in streams["chat/False"] if c.choices[0].index == 0)
    assert text == plain_chat.choices[0].message.content


async def test_count_tokens_counts_the_prompt_that_messages_renders(url: str) -> None:
    client = anthropic.AsyncAnthropic(
        base_url=url, api_key=KEY, max_retries=0, default_headers={"X-Gyre-Execution-Id": "count-e0"}
    )
    conversation: dict[str, Any] = {
        "system": "You answer questions about the weather.",
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "call_0_0", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "call_0_0", "content": "sunny"}],
            },
        ],
        "tools": [{"name": "get_weather", "description": "Weather of a city.", "input_schema": SCHEMA}],
    }
    try:
        counted = await client.messages.count_tokens(model="gyre", **conversation)
        message = await client.messages.create(model="gyre", max_tokens=2, **conversation)
        bare = await client.messages.count_tokens(model="gyre", messages=conversation["messages"][:1])
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.count_tokens(model="gyre", messages=[], extra_body={})
    finally:
        await client.close()
    prompt_ids = (message.model_extra or {})["prompt_token_ids"]
    assert counted.input_tokens == message.usage.input_tokens == len(prompt_ids)
    assert 0 < bare.input_tokens < counted.input_tokens
    assert refused.value.body["type"] == "error"  # type: ignore[index]
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


ANTHROPIC_PATHS = ["/v1/messages/nope", "/v1/messages/count_tokens/x", "/x/some-token/v1/messages/nope"]
OPENAI_PATHS = ["/v1/nope", "/v1/chat/nope", "/nope", "/x/some-token/v1/nope"]


async def test_every_error_comes_in_the_apis_own_shape(url: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
        for path in ANTHROPIC_PATHS:
            r = await http.post(path, json={})
            assert r.status_code == 404, path
            assert r.json() == {
                "type": "error",
                "error": {"type": "not_found_error", "message": f"no route POST {path}"},
            }, path
        for path in OPENAI_PATHS:
            r = await http.post(path, json={})
            assert r.status_code == 404, path
            assert r.json()["error"]["type"] == "not_found_error" and path in r.json()["error"]["message"]
        r = await http.get("/v1/messages")
        assert r.status_code == 405 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = await http.get("/v1/chat/completions")
        assert r.status_code == 405 and set(r.json()) == {"error"}, r.text
        r = await http.post("/v1/messages/count_tokens", json={"messages": "x"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    async with httpx.AsyncClient(base_url=url, headers={"x-api-key": "bad-key"}, timeout=30) as http:
        r = await http.post("/v1/messages/count_tokens", json={"messages": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    client = anthropic.AsyncAnthropic(base_url=url + "/v1/nowhere", api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="gyre", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    await client.close()
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    oai = openai.AsyncOpenAI(base_url=url + "/v2", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as gone:
        await oai.models.list()
    await oai.close()
    assert gone.value.body["type"] == "not_found_error"  # type: ignore[index]
