"""A FAKE `vllm serve` (vLLM 0.34's HTTP API), for testing Gyre's vLLM engine without a GPU.

This is a test fake at the outermost edge: vLLM is an external server, and it cannot be installed
on the CI machines (docs/model.md says what has and has not run against a real vLLM). It enforces
the parts of vLLM's API that Gyre relies on, strictly:

- the command line of `vllm serve MODEL [flags]`, with only flags vLLM 0.34 has (unknown: exit 2,
  as argparse does) and the environment Gyre must set (VLLM_SERVER_DEV_MODE=1 for the dev routes,
  CUDA_VISIBLE_DEVICES with tensor_parallel_size GPUs);
- `--api-key` on the /v1 routes (401 otherwise), as vLLM's middleware does; the dev routes take none;
- `POST /v1/completions`: vLLM's CompletionRequest fields (any other field is refused with 400,
  stricter than vLLM, which ignores them with a warning), `prompt` as token ids, `stream` as SSE
  with `token_ids` deltas and `logprobs.token_logprobs` per chunk and `data: [DONE]`,
  `finish_reason` "stop" / "length" / "abort";
- dev routes: `/sleep?level=&mode=`, `/wake_up?tags=`, `/is_sleeping`, `/pause?mode=abort|wait|keep`,
  `/resume`, `/is_paused`, `/abort_requests {"request_ids"}`, `/collective_rpc {"method", "args",
  "kwargs", "timeout"}` whose args/kwargs must be strings and whose method is looked up on the
  worker class with the `--worker-extension-cls` mixed in (Gyre's real extension runs here);
- `/health`, `/v1/models`.

The model is a real HF checkpoint run with transformers on CPU (greedy: argmax; sampling: a
torch.Generator seeded from the request's seed, reset per request as vLLM does). Sleep level 2
really discards the weights (they become NaN), so an engine that forgets to reload after waking
produces NaN log-probs. `FAKE_VLLM_TOKEN_DELAY_S` slows each token down so a test can cut a
request mid-stream. `GET /fake/state` reports what the fake saw (for assertions).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError


class CompletionRequest(BaseModel):
    """The CompletionRequest fields of vLLM 0.34 that a token-id client may send (others: 400)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: list[int] | str
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    echo: bool | None = False
    n: int = 1
    user: str | None = None
    request_id: str | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`vllm serve MODEL ...`: the flags Gyre may pass (a subset of vLLM 0.34's, same spelling)."""
    parser = argparse.ArgumentParser(prog="vllm")
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("model")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key")
    serve.add_argument("--served-model-name", nargs="+")
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--enable-sleep-mode", action="store_true")
    serve.add_argument("--worker-extension-cls", default="")
    serve.add_argument("--enforce-eager", action="store_true")
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--enable-prefix-caching", action="store_true")
    return parser.parse_args(argv)


class FakeModelRunner:
    """What a vLLM worker's `model_runner` offers the extension: `reload_weights` (from the checkpoint or
    from given tensors, as vLLM's does) on a model whose `load_weights` takes (HF name, tensor) pairs."""

    def __init__(self, path: str) -> None:
        import transformers

        self.path = path
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32
        ).eval()
        self.model.load_weights = self._load_weights  # type: ignore[attr-defined]
        self.loads: list[list[str]] = []

    def _load_weights(self, weights: Any) -> set[str]:
        """vLLM models take (HF name, tensor) pairs; an unknown name or a wrong shape is an error."""
        params = dict(self.model.named_parameters())
        seen = []
        with torch.no_grad():
            for name, tensor in weights:
                if name not in params:
                    raise KeyError(f"unknown parameter {name}")
                if tuple(params[name].shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"{name}: shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                    )
                params[name].copy_(tensor.to(params[name].dtype))
                seen.append(name)
        self.loads.append(seen)
        return set(seen)

    def reload_weights(self, weights_iterator: Any = None) -> None:
        """vLLM's `reload_weights`: the given (HF name, tensor) pairs, or the checkpoint from disk."""
        import transformers

        if weights_iterator is not None:
            self._load_weights(weights_iterator)
            return
        fresh = transformers.AutoModelForCausalLM.from_pretrained(
            self.path, local_files_only=True, dtype=torch.float32
        )
        self._load_weights(fresh.state_dict().items())


class FakeModelConfig:
    def __init__(self, model: str) -> None:
        self.model = model


class FakeWorkerBase:
    def __init__(self, model: str) -> None:
        self.model_config = FakeModelConfig(model)
        self.model_runner = FakeModelRunner(model)


def build_worker(model: str, extension: str) -> Any:
    """The worker with the extension class mixed in, as vLLM does with --worker-extension-cls."""
    bases: tuple[type, ...] = (FakeWorkerBase,)
    if extension:
        module, _, name = extension.rpartition(".")
        bases = (FakeWorkerBase, getattr(importlib.import_module(module), name))
    return type("FakeWorker", bases, {})(model)


class FakeVLLM:
    """The server's state: worker, sleep and pause flags, live requests, and a record for tests."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.worker = build_worker(args.model, args.worker_extension_cls)
        self.names = args.served_model_name or [args.model]
        self.sleeping: set[str] = set()  # "weights", "kv_cache" while asleep
        self.paused = False
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.live: dict[str, dict[str, Any]] = {}  # request id -> {"abort": bool}
        self.idle = asyncio.Event()
        self.idle.set()
        self.record: dict[str, Any] = {
            "completions": 0,
            "aborted": 0,
            "sleeps": [],
            "wakes": [],
            "rpcs": [],
            "prompts": [],
            "streamed": {},
        }
        self.token_delay_s = float(os.environ.get("FAKE_VLLM_TOKEN_DELAY_S", "0"))

    @property
    def model(self) -> Any:
        return self.worker.model_runner.model

    def step(self, ids: list[int], temperature: float, gen: torch.Generator | None) -> tuple[int, float]:
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
        if temperature and temperature > 0:
            logp = torch.log_softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(logp.exp(), 1, generator=gen).item())
        else:
            logp = torch.log_softmax(logits, dim=-1)
            token = int(torch.argmax(logits).item())
        return token, float(logp[token].item())


def create_app(state: FakeVLLM) -> FastAPI:
    app = FastAPI()
    dev = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Any:
        if state.args.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {state.args.api_key}":
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        if not dev and request.url.path in DEV_PATHS:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": n, "object": "model"} for n in state.names]}

    @app.get("/fake/state")
    async def fake_state() -> dict[str, Any]:
        return {
            **state.record,
            "sleeping": sorted(state.sleeping),
            "paused": state.paused,
            "live": len(state.live),
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        try:
            body = CompletionRequest.model_validate(await request.json())
        except (ValidationError, ValueError) as exc:
            return JSONResponse(
                {"error": {"message": str(exc)[:800], "type": "BadRequestError", "code": 400}}, 400
            )
        if body.model is not None and body.model not in state.names:
            return JSONResponse(
                {"error": {"message": f"The model `{body.model}` does not exist.", "code": 404}}, 404
            )
        if isinstance(body.prompt, str) or not body.prompt:
            return JSONResponse(
                {"error": {"message": "this fake takes token-id prompts only", "code": 400}}, 400
            )
        if state.sleeping:
            return JSONResponse({"error": {"message": "engine is sleeping", "code": 503}}, 503)
        await state.unpaused.wait()
        rid = f"cmpl-{body.request_id or uuid.uuid4().hex}-0"  # vLLM's id of the one prompt (abort takes it)
        state.record["completions"] += 1
        return (
            StreamingResponse(generate(state, body, rid), media_type="text/event-stream")
            if body.stream
            else (JSONResponse(await collect(state, body, rid)))
        )

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        level = int(request.query_params.get("level", "1"))
        for entry in list(state.live.values()):  # vLLM's default mode "abort"
            entry["abort"] = True
        await state.idle.wait()
        if level == 2:  # weights and KV cache discarded: what is left is garbage
            with torch.no_grad():
                for p in state.model.parameters():
                    p.fill_(float("nan"))
        state.sleeping = {"weights", "kv_cache"}
        state.record["sleeps"].append(level)
        print(f"fake vllm: sleep level {level}", flush=True)
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or ["weights", "kv_cache"]
        state.sleeping -= set(tags)
        state.record["wakes"].append(tags)
        print(f"fake vllm: wake_up {tags}", flush=True)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": bool(state.sleeping)}

    @app.post("/pause")
    async def pause(request: Request) -> dict[str, str]:
        mode = request.query_params.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            raise HTTPException(400, f"mode must be abort, wait or keep, got {mode!r}")
        state.paused = True
        state.unpaused.clear()
        if mode == "abort":
            for entry in state.live.values():
                entry["abort"] = True
        if mode in ("abort", "wait"):
            await state.idle.wait()
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict[str, str]:
        state.paused = False
        state.unpaused.set()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": state.paused}

    @app.post("/abort_requests")
    async def abort_requests(request: Request) -> dict[str, Any]:
        body = await request.json()
        ids = body.get("request_ids") or list(state.live)
        for rid in ids:
            if rid in state.live:
                state.live[rid]["abort"] = True
        state.record["aborted"] += len(ids)
        return {"status": "aborted", "aborted": len(ids)}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError as exc:
            raise HTTPException(400, f"JSON decode error: {exc}") from exc
        method = body.get("method")
        if method is None:
            raise HTTPException(400, "Missing 'method' in request body")
        args, kwargs = body.get("args", []), body.get("kwargs", {})
        if not all(isinstance(a, str) for a in args) or not all(isinstance(v, str) for v in kwargs.values()):
            raise HTTPException(400, "collective_rpc args and kwargs must be strings")
        fn = getattr(state.worker, method, None)
        if fn is None:
            raise HTTPException(500, f"worker has no method {method!r}")
        try:
            results = [fn(*args, **kwargs) for _ in range(state.args.tensor_parallel_size)]
        except Exception as exc:  # vLLM surfaces a worker exception as a server error
            return JSONResponse({"error": repr(exc)}, status_code=500)
        state.record["rpcs"].append(method)
        print(f"fake vllm: collective_rpc {method} {json.dumps(kwargs.get('version', ''))}", flush=True)
        return {"results": [r if r is None or isinstance(r, dict | list) else str(r) for r in results]}

    return app


DEV_PATHS = {"/sleep", "/wake_up", "/is_sleeping", "/pause", "/resume", "/is_paused", "/abort_requests",
             "/collective_rpc"}  # fmt: skip


async def _tokens(state: FakeVLLM, body: CompletionRequest, rid: str) -> Any:
    """Yield (token, logprob, finish_reason or None) as vLLM's engine would produce them."""
    assert isinstance(body.prompt, list)
    ids = list(body.prompt)
    gen = None
    if body.temperature:
        gen = torch.Generator().manual_seed(body.seed if body.seed is not None else state.args.seed)
    stops = set(body.stop_token_ids or [])
    entry = {"abort": False}
    state.live[rid] = entry
    state.record["prompts"].append(list(body.prompt))
    streamed = state.record["streamed"].setdefault(rid, [])
    state.idle.clear()
    try:
        for i in range(body.max_tokens or 16):
            if entry["abort"]:
                yield None, None, "abort"
                return
            token, lp = state.step(ids, body.temperature or 0.0, gen)
            ids.append(token)
            streamed.append(token)
            last = i + 1 == (body.max_tokens or 16)
            reason = "stop" if token in stops else ("length" if last else None)
            yield token, lp, reason
            if reason:
                return
            await asyncio.sleep(state.token_delay_s)
    finally:
        state.live.pop(rid, None)
        if not state.live:
            state.idle.set()


def _chunk(
    state: FakeVLLM, rid: str, tokens: list[int], lps: list[float], reason: str | None
) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": state.names[0],
        "choices": [{
            "index": 0, "text": "", "token_ids": tokens, "finish_reason": reason, "stop_reason": None,
            "logprobs": {"text_offset": [0] * len(tokens), "token_logprobs": lps,
                         "tokens": [f"token_id:{t}" for t in tokens], "top_logprobs": [{} for _ in tokens]},
        }],
    }  # fmt: skip


async def generate(state: FakeVLLM, body: CompletionRequest, rid: str) -> Any:
    async for token, lp, reason in _tokens(state, body, rid):
        tokens, lps = ([token], [lp]) if token is not None else ([], [])
        yield f"data: {json.dumps(_chunk(state, rid, tokens, lps, reason))}\n\n"
    yield "data: [DONE]\n\n"


async def collect(state: FakeVLLM, body: CompletionRequest, rid: str) -> dict[str, Any]:
    tokens: list[int] = []
    lps: list[float] = []
    finish = None
    async for token, lp, reason in _tokens(state, body, rid):
        finish = reason
        if token is not None:
            tokens.append(token)
            lps.append(lp)
    return _chunk(state, rid, tokens, lps, finish)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(sys.argv[1:] if argv is None else argv)
    gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    if len(gpus) != args.tensor_parallel_size:
        sys.exit(f"fake vllm: CUDA_VISIBLE_DEVICES={gpus} does not hold {args.tensor_parallel_size} GPUs")
    if not Path(args.model, "config.json").is_file():
        sys.exit(f"fake vllm: {args.model} is not a model directory")
    state = FakeVLLM(args)
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
