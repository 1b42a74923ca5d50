"""The OpenAI-compatible endpoint, driven by the official `openai` client, with steps on real NATS;
and the vLLM engine's HTTP protocol, exercised against this same endpoint (no real vLLM here).
Also its trust boundary: keys, admin routes, request validation and execution ownership."""

import asyncio
import json

import httpx
import openai
import pytest

from gyre import tokenizer as tok
from gyre.bus import Bus, subjects
from gyre.model import ModelConfig
from gyre.v1 import events_pb2
from services.rollout.engines.base import GenerationRequest, Sampling
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.openai import OpenAIEndpoint, create_app, serve
from services.rollout.router import Router
from services.rollout.steps import BusStepSink
from tests.helpers.stream import expanded_prompts

RUN = "openai-test"
API_KEY = "run-key-0123456789abcdef"
ADMIN_KEY = "admin-key-0123456789abcdef"


async def start_stack(
    nats_url: str, **endpoint_options: float
) -> tuple[Bus, BusStepSink, Router, OpenAIEndpoint, object, int]:
    bus = await Bus.connect(nats_url, name="rollout-openai-test")
    await bus.ensure_streams()
    sink = BusStepSink(bus, max_buffer=64, batch_size=8)
    sink.start()
    router = Router()
    engine = TorchEngine("e0", "cpu0-0", ModelConfig.model_validate({}), init_seed=3)
    await engine.start()
    await router.add_engine(engine)
    endpoint = OpenAIEndpoint(
        router, sink, run_id=RUN, api_key=API_KEY, admin_key=ADMIN_KEY, **endpoint_options
    )
    server, port = await serve(create_app(endpoint), "127.0.0.1", 0)
    return bus, sink, router, endpoint, server, port


async def stop_stack(bus: Bus, sink: BusStepSink, router: Router, server: object) -> None:
    server.should_exit = True  # type: ignore[attr-defined]
    await server.gyre_task  # type: ignore[attr-defined]
    for d in list(router.engines):
        await router.remove_engine(d)
    await sink.flush()
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
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY)
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
    prompts = expanded_prompts(received)  # steps after the first travel compact
    for resp in responses:
        extra = resp.model_extra or {}
        step = next(s for s in received if list(s.completion_token_ids) == extra["token_ids"])
        assert prompts[step.call_seq] == extra["prompt_token_ids"]  # captured server-side
        assert (
            len(step.completion_logprobs) == len(step.completion_versions) == len(step.completion_token_ids)
        )
    assert len(prompts[2]) > len(prompts[0])


async def test_completions_take_token_ids_and_return_logprobs(nats_url: str) -> None:
    bus, sink, router, endpoint, server, port = await start_stack(nats_url)
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY)
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
                model="gyre", prompt=[9999], max_tokens=2, user="cmp-e0"
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


def chat_body(**overrides: object) -> dict:
    return {"model": "gyre", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **overrides}


async def test_the_endpoint_refuses_calls_without_the_key_and_serves_no_vllm_stand_in_routes(
    nats_url: str,
) -> None:
    bus, sink, router, endpoint, server, port = await start_stack(nats_url)
    run = {"Authorization": f"Bearer {API_KEY}", "X-Gyre-Execution-Id": "auth-e0"}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {"Authorization": API_KEY}):
                r = await http.post("/v1/chat/completions", json=chat_body(), headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
                assert "key" in r.json()["error"]["message"]
            assert (await http.get("/v1/models")).status_code == 401
            with pytest.raises(openai.AuthenticationError):
                bad = openai.AsyncOpenAI(
                    base_url=f"http://127.0.0.1:{port}/v1", api_key="nope", max_retries=0
                )
                await bad.chat.completions.create(model="gyre", messages=[{"role": "user", "content": "x"}])
            r = await http.post("/v1/chat/completions", json=chat_body(), headers=run)
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"]
            for path in ("/sleep", "/wake_up", "/collective_rpc"):  # the vLLM stand-in routes are gone
                assert (
                    await http.post(path, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                ).status_code == 404
    finally:
        await stop_stack(bus, sink, router, server)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", chat_body(max_tokens="lots"), "max_tokens"),
        ("/v1/chat/completions", chat_body(messages=["hello"]), "messages"),
        ("/v1/chat/completions", chat_body(tools=[1, 2]), "tools"),
        ("/v1/chat/completions", chat_body(messages=[]), "messages"),
        ("/v1/chat/completions", chat_body(messages=[{"role": "wizard", "content": "x"}]), "role"),
        ("/v1/chat/completions", chat_body(temperature=[1]), "temperature"),
        ("/v1/chat/completions", chat_body(temperature=1e-300), "temperature"),  # NaN log-probs in float32
        ("/v1/completions", {"prompt": "hi", "top_p": 1e-300}, "top_p"),
        ("/v1/chat/completions", chat_body(metadata={"execution_id": 5}), "metadata"),
        ("/v1/completions", {"prompt": [True, False], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": ["x"]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed"),
        ("/v1/completions", {"prompt": "", "max_tokens": 2}, "empty"),
        ("/v1/completions", {"prompt": [5000], "max_tokens": 2}, "token ids"),
        ("/v1/completions", [1, 2], "body"),
        ("/v1/completions", "not json", "json"),
    ],
)
async def test_wrongly_typed_bodies_get_400_with_the_field_and_the_connection_keeps_working(
    nats_url: str, path: str, body: object, field: str
) -> None:
    bus, sink, router, endpoint, server, port = await start_stack(nats_url)
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Gyre-Execution-Id": "types-e0"}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers) as http:
            if body == "not json":
                r = await http.post(path, content=b"{not json", headers={"content-type": "application/json"})
            else:
                r = await http.post(path, json=body)
            assert r.status_code == 400, r.text
            assert field in r.json()["error"]["message"].lower()
            ok = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})  # same connection
            assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2
    finally:
        await stop_stack(bus, sink, router, server)


async def test_oversized_bodies_and_prompts_are_refused_before_tokenising(nats_url: str) -> None:
    bus, sink, router, endpoint, server, port = await start_stack(nats_url)
    endpoint.max_request_bytes = 64 << 10
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Gyre-Execution-Id": "big-e0"}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers) as http:
            r = await http.post("/v1/completions", json={"prompt": "x" * (100 << 10)})
            assert r.status_code == 413
            r = await http.post("/v1/completions", json={"prompt": "x" * (endpoint.max_prompt_tokens + 1)})
            assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
            assert endpoint.executions == {}  # refused before any execution was opened
    finally:
        await stop_stack(bus, sink, router, server)


async def test_a_call_naming_no_execution_is_refused_with_how_to_name_it(nats_url: str) -> None:
    bus, sink, router, endpoint, server, port = await start_stack(nats_url)
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="X-Gyre-Execution-Id") as err:
            await client.chat.completions.create(model="gyre", messages=[{"role": "user", "content": "x"}])
        assert "/gyre/executions" in str(err.value) and endpoint.executions == {}
        await client.close()
    finally:
        await stop_stack(bus, sink, router, server)


async def test_another_key_cannot_hijack_an_execution_by_naming_its_id(nats_url: str) -> None:
    bus, sink, router, endpoint, server, port = await start_stack(nats_url)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            r = await http.post(
                "/gyre/executions", json={"task_id": "t-own"}, headers={"Authorization": f"Bearer {API_KEY}"}
            )
            issued = r.json()
            victim = issued["execution_id"]
            own = {"Authorization": f"Bearer {issued['api_key']}"}
            assert (await http.post("/v1/chat/completions", json=chat_body(), headers=own)).status_code == 200
            # The run key naming the issued execution's id (header, metadata or user) is refused.
            thief = {"Authorization": f"Bearer {API_KEY}"}
            for attempt in ({"headers": {**thief, "X-Gyre-Execution-Id": victim}, "json": chat_body()},
                            {"headers": thief, "json": chat_body(metadata={"execution_id": victim})},
                            {"headers": thief, "json": chat_body(user=victim)}):  # fmt: skip
                r = await http.post("/v1/chat/completions", **attempt)  # type: ignore[arg-type]
                assert r.status_code == 403 and "another client" in r.text
            # ... and so is ending it, or steering the per-execution key into another execution.
            assert (
                await http.post(f"/gyre/executions/{victim}/end", json={}, headers=thief)
            ).status_code == 403
            other = {**own, "X-Gyre-Execution-Id": "someone-else"}
            assert (
                await http.post("/v1/chat/completions", json=chat_body(), headers=other)
            ).status_code == 403
            assert endpoint.executions[victim].calls == 1
    finally:
        await stop_stack(bus, sink, router, server)


async def test_an_unmodified_openai_client_on_an_issued_endpoint_lands_in_one_execution(
    nats_url: str,
) -> None:
    from services.rollout.openai import issue_execution_endpoint

    bus, sink, router, endpoint, server, port = await start_stack(nats_url)
    received: list[events_pb2.ExecutionEvent] = []

    async def collect() -> None:
        async for ev in bus.tail(subjects.executions(RUN, "t-byo"), events_pb2.ExecutionEvent):
            received.append(ev)
            return

    collector = asyncio.create_task(collect())
    await asyncio.sleep(0.2)
    try:
        base_url, key = issue_execution_endpoint(endpoint, task_id="t-byo", group_id="t-byo-g3")
        assert base_url.startswith(f"http://127.0.0.1:{port}/x/") and base_url.endswith("/v1")
        for client in (openai.AsyncOpenAI(base_url=base_url, api_key="anything", max_retries=0),
                       openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)):  # fmt: skip
            await client.chat.completions.create(
                model="gyre", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
        (execution_id,) = endpoint.executions
        assert endpoint.executions[execution_id].calls == 2
        assert endpoint.executions[execution_id].spec.group_id == "t-byo-g3"
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{base_url.removesuffix('/v1')}/gyre/end", json={"reward": 0.5})
            assert r.json() == {"execution_id": execution_id, "num_calls": 2}
            r = await http.post(f"{base_url}/chat/completions", json=chat_body())
            assert r.status_code == 401  # the ended execution's URL no longer works
            late = {"Authorization": f"Bearer {API_KEY}", "X-Gyre-Execution-Id": execution_id}
            assert (
                await http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", json=chat_body(), headers=late
                )
            ).status_code == 409
        await asyncio.wait_for(collector, 20)
        assert received[0].execution_id == execution_id and received[0].reward == 0.5
    finally:
        await stop_stack(bus, sink, router, server)


async def test_idle_executions_are_ended_as_truncated_never_left_open(nats_url: str) -> None:
    bus, sink, router, endpoint, server, port = await start_stack(
        nats_url, execution_idle_s=0.05, reap_interval_s=0.05
    )
    ended: list[events_pb2.ExecutionEvent] = []

    async def collect() -> None:
        async for ev in bus.tail(subjects.executions(RUN, "openai"), events_pb2.ExecutionEvent):
            if ev.execution_id == "idle-e0":
                ended.append(ev)
                return

    collector = asyncio.create_task(collect())
    await asyncio.sleep(0.2)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            headers = {"Authorization": f"Bearer {API_KEY}", "X-Gyre-Execution-Id": "idle-e0"}
            assert (
                await http.post("/v1/chat/completions", json=chat_body(), headers=headers)
            ).status_code == 200
            await sink.flush()
            await asyncio.wait_for(collector, 20)  # no further call: the background reaper ends it
            assert ended[0].kind == events_pb2.ExecutionEvent.KIND_TRUNCATED and ended[0].num_calls == 1
            assert "idle-e0" not in endpoint.executions
            assert (
                await http.post("/v1/chat/completions", json=chat_body(), headers=headers)
            ).status_code == 409
    finally:
        await stop_stack(bus, sink, router, server)


def test_generated_keys_are_private_files_reused_on_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from services.rollout.openai import endpoint_keys

    api, admin = endpoint_keys(None, None, tmp_path / "keys")
    assert api and admin and api != admin and len(api) >= 32
    for name in ("openai_api_key", "openai_admin_key"):
        assert (tmp_path / "keys" / name).stat().st_mode & 0o777 == 0o600
    assert endpoint_keys(None, None, tmp_path / "keys") == (api, admin)
    assert endpoint_keys("configured-key-0123", None, tmp_path / "keys") == ("configured-key-0123", admin)
    assert endpoint_keys(None, None, tmp_path / "keys", require_api_key=False)[0] is None
