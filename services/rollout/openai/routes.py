"""The OpenAI routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`), the Anthropic
`/v1/messages` and `/v1/messages/count_tokens` routes (on the chat path, anthropic_messages.py) and the execution routes (`/gyre/executions`, `/gyre/executions/{id}/end`, `/gyre/end`).

Token ids are captured server-side: every response carries Gyre extras `prompt_token_ids`,
`token_ids`, `token_logprobs` and `token_versions` (per choice), exactly what the engine saw and
produced, so nobody re-tokenises.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response

from gyre.errors import InvalidArgument

from ..engines.base import Completion
from .anthropic_messages import (
    CountTokensRequest,
    MessagesRequest,
    message_events,
    to_chat_request,
    to_message,
)
from .auth import Caller, issue_execution_endpoint
from .endpoint import OpenAIEndpoint
from .responses import (
    chat_choice,
    chat_logprobs,
    chat_messages,
    completion_logprobs,
    envelope,
    extras,
    finish,
    num_chars,
    tool_specs,
)
from .schema import ChatRequest, CompletionRequest, EndRequest, IssueRequest, forbidden, refuse_unsupported
from .streaming import chat_events, completion_events, sse


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


@model_routes.post("/v1/completions", response_model=None)
async def completions(
    request: Request, endpoint: EndpointDep, caller: CallerDep
) -> dict[str, Any] | Response:
    body = await endpoint.parse(request, CompletionRequest)
    refuse_unsupported(body)
    tokenizer = endpoint.tokenizer
    if isinstance(body.prompt, str):
        endpoint.check_prompt_chars(len(body.prompt))
        prompt = await asyncio.to_thread(tokenizer.encode, body.prompt)
    elif body.prompt and isinstance(body.prompt[0], list):
        prompt = list(body.prompt[0])
    else:
        prompt = [t for t in body.prompt if isinstance(t, int)]
    endpoint.check_prompt_ids(prompt)
    state = await endpoint.execution(request, caller, body)
    first_seq = state.calls
    samples = await endpoint.samples(state, prompt, body)
    choices = []
    for index, (c, stop_text) in enumerate(samples):
        text = tokenizer.decode(c.token_ids) if stop_text is None else stop_text
        choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": finish(c)}
        if body.logprobs is not None and body.logprobs is not False:
            choice["logprobs"] = completion_logprobs(c, tokenizer)
        choices.append(choice | extras(prompt, c))
    cs = [c for c, _ in samples]
    response = envelope(
        f"cmpl-{state.spec.execution_id}-{first_seq}",
        "text_completion",
        endpoint.model_name,
        choices,
        prompt,
        cs,
    )
    if body.stream:
        return sse(completion_events(response, cs, tokenizer, body.include_usage()))
    return response


async def render_prompt(
    endpoint: OpenAIEndpoint, body: ChatRequest
) -> tuple[list[int], list[dict[str, Any]] | None]:
    """(prompt ids, the tools rendered) of a chat request under the run's chat template."""
    refuse_unsupported(body)
    tokenizer = endpoint.tokenizer
    tools = tool_specs(body)
    if tools and not tokenizer.supports_tools:
        raise InvalidArgument(
            f"unsupported request field 'tools': tokenizer {tokenizer.spec!r} has no tool-call parser"
        )
    messages = chat_messages(body)
    endpoint.check_prompt_chars(num_chars(messages) + num_chars(tools))
    prompt = await asyncio.to_thread(lambda: tokenizer.apply_chat_template(messages, tools=tools))
    return prompt, tools


async def chat_call(
    request: Request, endpoint: OpenAIEndpoint, caller: Caller, body: ChatRequest
) -> tuple[dict[str, Any], list[tuple[Completion, str | None]], list[int]]:
    """One chat request through the endpoint (each sample a step): (response, samples, prompt ids).

    Shared by `/v1/chat/completions` and `/v1/messages` (anthropic_messages.py translates to and
    from it), so both render, generate, parse tool calls and store steps the same way.
    """
    tokenizer = endpoint.tokenizer
    prompt, tools = await render_prompt(endpoint, body)
    endpoint.check_prompt_ids(prompt)
    state = await endpoint.execution(request, caller, body)
    first_seq = state.calls
    samples = await endpoint.samples(state, prompt, body)
    choices = []
    for index, (c, stop_text) in enumerate(samples):
        choice = chat_choice(index, c, stop_text, tokenizer, first_seq + index, parse_tools=tools is not None)
        if body.logprobs:
            choice["logprobs"] = chat_logprobs(c, tokenizer)
        choices.append(choice | extras(prompt, c))
    cs = [c for c, _ in samples]
    response = envelope(
        f"chatcmpl-{state.spec.execution_id}-{first_seq}",
        "chat.completion",
        endpoint.model_name,
        choices,
        prompt,
        cs,
    )
    return response, samples, prompt


@model_routes.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    request: Request, endpoint: EndpointDep, caller: CallerDep
) -> dict[str, Any] | Response:
    body = await endpoint.parse(request, ChatRequest)
    response, samples, prompt = await chat_call(request, endpoint, caller, body)
    cs = [c for c, _ in samples]
    if body.stream:
        return sse(chat_events(response, cs, endpoint.tokenizer, body.include_usage()))
    return {**response, **extras(prompt, cs[0])}  # the first sample's extras at top level, as before


@model_routes.post("/v1/messages", response_model=None)
async def messages(request: Request, endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any] | Response:
    """The Anthropic Messages API on the same chat path (see anthropic_messages.py)."""
    body = await endpoint.parse(request, MessagesRequest)
    chat = to_chat_request(body)
    response, samples, prompt = await chat_call(request, endpoint, caller, chat)
    message = to_message(response, samples[0], prompt, endpoint.tokenizer, chat.stop_strings())
    if body.stream:
        return sse(message_events(message, samples[0][0], endpoint.tokenizer))
    return message


@model_routes.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    """Anthropic's token count: the prompt ids `/v1/messages` would render (its `input_tokens`);
    nothing is generated and no execution is opened or named."""
    body = await endpoint.parse(request, CountTokensRequest)
    prompt, _ = await render_prompt(endpoint, to_chat_request(body.as_messages_request()))
    return {"input_tokens": len(prompt)}


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
