"""The OpenAI routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`) and the execution
routes (`/gyre/executions`, `/gyre/executions/{id}/end`, `/gyre/end`).

Token ids are captured server-side: every response carries Gyre extras `prompt_token_ids`,
`token_ids`, `token_logprobs` and `token_versions` (per choice), exactly what the engine saw and
produced, so nobody re-tokenises.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from gyre import tokenizer as tok
from gyre.errors import InvalidArgument

from .auth import Caller, issue_execution_endpoint
from .endpoint import OpenAIEndpoint
from .responses import chat_messages, envelope, extras, finish, num_chars
from .schema import ChatRequest, CompletionRequest, EndRequest, IssueRequest, forbidden


def _endpoint(request: Request) -> OpenAIEndpoint:
    return request.app.state.endpoint  # type: ignore[no-any-return]


def _caller(request: Request) -> Caller:
    return _endpoint(request).authenticate(request)


EndpointDep = Annotated[OpenAIEndpoint, Depends(_endpoint)]
CallerDep = Annotated[Caller, Depends(_caller)]

model_routes = APIRouter()
control_routes = APIRouter()


@model_routes.get("/v1/models")
async def list_models(endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": endpoint.model_name, "object": "model", "owned_by": "gyre"}]}


@model_routes.post("/v1/completions")
async def completions(request: Request, endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    body = await endpoint.parse(request, CompletionRequest)
    if isinstance(body.prompt, str):
        endpoint.check_prompt_chars(len(body.prompt))
        prompt = await asyncio.to_thread(tok.encode, body.prompt)
    elif body.prompt and isinstance(body.prompt[0], list):
        prompt = list(body.prompt[0])
    else:
        prompt = [t for t in body.prompt if isinstance(t, int)]
    endpoint.check_prompt_ids(prompt)
    state = await endpoint.execution(request, caller, body)
    c = await endpoint.call(state, prompt, endpoint.sampling(body, state))
    choice: dict[str, Any] = {"index": 0, "text": tok.decode(c.token_ids), "finish_reason": finish(c)}
    if body.logprobs is not None and body.logprobs is not False:
        choice["logprobs"] = {
            "tokens": [tok.decode([t], skip_special=False) for t in c.token_ids],
            "token_logprobs": c.logprobs,
            "top_logprobs": None,
            "text_offset": None,
        }
    choice.update(extras(prompt, c))
    response_id = f"cmpl-{state.spec.execution_id}-{state.calls - 1}"
    return envelope(response_id, "text_completion", endpoint.model_name, choice, prompt, c)


@model_routes.post("/v1/chat/completions")
async def chat_completions(request: Request, endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    body = await endpoint.parse(request, ChatRequest)
    messages = chat_messages(body)
    endpoint.check_prompt_chars(num_chars(messages))
    prompt = await asyncio.to_thread(tok.apply_chat_template, messages)
    endpoint.check_prompt_ids(prompt)
    state = await endpoint.execution(request, caller, body)
    c = await endpoint.call(state, prompt, endpoint.sampling(body, state))
    turn = tok.parse_assistant(c.token_ids)
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    if turn.tool_calls:
        message["tool_calls"] = [
            {"id": f"{call.id}_{state.calls - 1}", "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for call in turn.tool_calls
        ]  # fmt: skip
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": finish(c, bool(turn.tool_calls)),
    }
    if body.logprobs:
        choice["logprobs"] = {
            "content": [
                {
                    "token": tok.decode([t], skip_special=False),
                    "logprob": lp,
                    "bytes": None,
                    "top_logprobs": [],
                }
                for t, lp in zip(c.token_ids, c.logprobs, strict=True)
            ]
        }
    choice.update(extras(prompt, c))
    response_id = f"chatcmpl-{state.spec.execution_id}-{state.calls - 1}"
    response = envelope(response_id, "chat.completion", endpoint.model_name, choice, prompt, c)
    return {**response, **extras(prompt, c)}


@model_routes.post("/gyre/end")
async def end_own_execution(request: Request, endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    """End the execution of a per-execution URL or key."""
    if caller.execution_id is None:
        raise InvalidArgument(
            "POST /gyre/end needs a per-execution URL or key; else use /gyre/executions/{id}/end"
        )
    return await _end(endpoint, caller, caller.execution_id, await endpoint.parse(request, EndRequest))


async def _end(
    endpoint: OpenAIEndpoint, caller: Caller, execution_id: str, body: EndRequest
) -> dict[str, Any]:
    state = endpoint.executions.get(execution_id)
    if state is not None and state.owner != caller.key_id and caller.kind != "admin":
        raise forbidden(f"execution {execution_id!r} belongs to another client")
    num_calls = await endpoint.end(execution_id, body.kind, reward=body.reward, error=body.error)
    return {"execution_id": execution_id, "num_calls": num_calls}


@control_routes.post("/gyre/executions")
async def issue_execution(request: Request, endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    """Open an execution; returns its `base_url` and `api_key` (see issue_execution_endpoint)."""
    if caller.kind == "execution":
        raise forbidden("a per-execution key cannot open executions")
    body = await endpoint.parse(request, IssueRequest)
    base_url, api_key = issue_execution_endpoint(
        endpoint, task_id=body.task_id, group_id=body.group_id, execution_id=body.execution_id
    )
    return {"execution_id": endpoint._tokens[api_key], "base_url": base_url, "api_key": api_key}


@control_routes.post("/gyre/executions/{execution_id}/end")
async def end_execution(
    execution_id: str, request: Request, endpoint: EndpointDep, caller: CallerDep
) -> dict[str, Any]:
    return await _end(endpoint, caller, execution_id, await endpoint.parse(request, EndRequest))
