"""Gyre's vLLM engine against a fake `vllm serve` that enforces vLLM 0.34's API (tests/helpers/fake_vllm.py).

The fake is the outermost edge (no vLLM can be installed here); it runs a real HF checkpoint with
transformers and Gyre's real worker extension. What these tests cannot show — a real vLLM's
scheduler, CUDA memory after sleep, tensor-parallel loading — is listed in docs/model.md.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
import uvicorn

from gyre.errors import InvalidArgument, Unavailable
from gyre.v1 import common_pb2
from services.rollout.engines.base import GenerationRequest, Sampling
from services.rollout.engines.vllm_engine import VLLMEngine
from services.rollout.engines.vllm_server import EXTENSION, VLLMServers, VLLMServerSpec, check_servable
from services.rollout.engines.vllm_worker import STORE_ENV, GyreWorkerExtension
from services.rollout.router import Router
from tests.helpers import fake_vllm
from tests.helpers.tiny_hf import tiny_qwen2_dir

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-vllm-key-0123456789"
PROMPT = [1, 5, 9, 14, 3, 7]


def publish(store: Path, version: int, scale: float) -> common_pb2.WeightVersion:
    """A version as the trainer publishes it: Megatron names, safetensors, sha256 (perturbed weights)."""
    from gyre.model.hf import import_hf
    from gyre.model.weights import save_weights

    model = import_hf(tiny_qwen2_dir())
    with torch.no_grad():
        gen = torch.Generator().manual_seed(version)
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    path = store / f"v{version:06d}.safetensors"
    digest = save_weights(model, path)
    return common_pb2.WeightVersion(version=version, uri=path.resolve().as_uri(), sha256=digest)


def hf_tensors(weights: common_pb2.WeightVersion) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from gyre.model.hf import megatron_to_hf, read_hf_config

    path = Path(weights.uri.removeprefix("file://"))
    return megatron_to_hf(load_file(str(path)), read_hf_config(tiny_qwen2_dir()))


class Fake:
    """One in-process fake vLLM server (uvicorn in this event loop)."""

    def __init__(self, state: fake_vllm.FakeVLLM, server: uvicorn.Server, task: asyncio.Task[None], url: str):
        self.state, self.server, self.task, self.url = state, server, task, url

    def engine(self, engine_id: str, **kwargs: object) -> VLLMEngine:
        return VLLMEngine(engine_id, f"gpu0-{engine_id}", self.url, api_key=KEY, start_timeout_s=30, **kwargs)  # type: ignore[arg-type]

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_fake(token_delay_s: float = 0.0) -> Fake:
    argv = ["serve", str(tiny_qwen2_dir()), "--api-key", KEY, "--served-model-name", "gyre",
            "--enable-sleep-mode", "--worker-extension-cls", EXTENSION]  # fmt: skip
    state = fake_vllm.FakeVLLM(fake_vllm.parse_args(argv))
    state.token_delay_s = token_delay_s
    server = uvicorn.Server(
        uvicorn.Config(fake_vllm.create_app(state), host="127.0.0.1", port=0, log_level="warning")
    )
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn.Server exposes a flag, no event
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return Fake(state, server, task, f"http://127.0.0.1:{port}")


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv(STORE_ENV, str(tmp_path))
    return tmp_path


def request(max_tokens: int = 12, temperature: float = 0.0, seed: int = 3) -> GenerationRequest:
    return GenerationRequest(
        "r0", PROMPT, Sampling(temperature=temperature, max_tokens=max_tokens, seed=seed, stop_token_ids=()),
        execution_id="e0",
    )  # fmt: skip


def test_the_vllm_serve_command_line_carries_gyres_flags_and_parses_as_vllm_serve() -> None:
    spec = VLLMServerSpec(
        model=Path("/models/policy"), port=8100, api_key="k" * 20, gpus=(2, 3), weights_store=Path("/run/weights"),
        max_model_len=4096, seed=7, extra_args=("--enforce-eager",),
    )  # fmt: skip
    assert spec.argv() == [
        "vllm", "serve", "/models/policy", "--host", "127.0.0.1", "--port", "8100", "--api-key", "k" * 20,
        "--served-model-name", "gyre", "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.85",
        "--max-model-len", "4096", "--seed", "7", "--enable-sleep-mode", "--worker-extension-cls", EXTENSION,
        "--enforce-eager",
    ]  # fmt: skip
    env = spec.env({"PATH": "/bin"})
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env[STORE_ENV] == "/run/weights" and env["PATH"] == "/bin"
    parsed = fake_vllm.parse_args(spec.argv()[1:])
    assert (
        parsed.tensor_parallel_size == 2 and parsed.enable_sleep_mode and parsed.served_model_name == ["gyre"]
    )
    module, _, name = parsed.worker_extension_cls.rpartition(".")
    assert getattr(importlib.import_module(module), name) is GyreWorkerExtension
    servers = VLLMServers.for_devices(
        ["gpu0-0", "gpu0-1"],
        model=Path("m"),
        weights_store=Path("w"),
        log_dir=Path("l"),
        tensor_parallel_size=2,
    )
    a, b = servers.spec("gpu0-0"), servers.spec("gpu0-1")
    assert (a.gpus, b.gpus) == ((0, 1), (2, 3)) and a.port != b.port and a.api_key == b.api_key
    assert a.model.is_absolute() and a.weights_store.is_absolute()


def test_a_cpu_server_starts_from_its_own_python_without_sleep_mode_with_a_kv_space_and_the_project_on_its_path() -> (
    None
):
    spec = VLLMServerSpec(
        model=Path("/models/policy"), port=8100, api_key="k" * 20, gpus=(0,), weights_store=Path("/run/weights"),
        python=Path("/opt/vllm-env/bin/python"), platform="cpu", cpu_kv_cache_gib=2, max_model_len=1024,
    )  # fmt: skip
    argv = spec.argv()
    assert argv[:5] == [
        "/opt/vllm-env/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/policy",
    ]
    assert (
        "--enable-sleep-mode" not in argv and "--gpu-memory-utilization" not in argv and not spec.sleep_mode
    )
    assert argv[argv.index("--worker-extension-cls") + 1] == EXTENSION
    env = spec.env({"PATH": "/bin", "PYTHONPATH": "/site/of/.venv", "VIRTUAL_ENV": "/work/.venv"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and "CUDA_VISIBLE_DEVICES" not in env
    assert env["PYTHONPATH"] == str(ROOT) and "VIRTUAL_ENV" not in env  # the project, not Gyre's environment
    assert env["PATH"].split(os.pathsep)[0] == "/opt/vllm-env/bin" and env["VLLM_SERVER_DEV_MODE"] == "1"


def test_a_checkpoint_the_cpu_attention_cannot_serve_is_refused_before_any_server_starts(
    tmp_path: Path,
) -> None:
    with pytest.raises(InvalidArgument, match=r"does not serve head_dim 16 .* it serves head_dim \[32, 64"):
        VLLMServers.for_devices(
            ["cpu0-0"], model=tiny_qwen2_dir(), weights_store=tmp_path, log_dir=tmp_path, platform="cpu"
        )
    check_servable(tiny_qwen2_dir(), "cuda")  # GPU attention kernels have no such limit here
    with pytest.raises(InvalidArgument, match="not an executable Python.*make vllm-venv"):
        VLLMServers.for_devices(
            ["cpu0-0"], model=tmp_path, weights_store=tmp_path, log_dir=tmp_path, python=tmp_path / "python",
            platform="cpu",
        )  # fmt: skip


def test_the_vllm_platform_follows_the_device_kind_and_python_excludes_command() -> None:
    from services.rollout.config import RolloutConfig

    cpu = RolloutConfig.model_validate(
        {"engine": "vllm", "vllm": {"model": "/m", "python": ".venv-vllm/bin/python"}}
    )
    assert cpu.vllm.platform_for(cpu.device_kind) == "cpu" and cpu.vllm.cpu_kv_cache_gib == 1
    gpu = RolloutConfig.model_validate({"engine": "vllm", "device_kind": "cuda", "vllm": {"model": "/m"}})
    assert gpu.vllm.platform_for(gpu.device_kind) == "cuda"
    forced = RolloutConfig.model_validate({"engine": "vllm", "vllm": {"model": "/m", "platform": "cuda"}})
    assert forced.vllm.platform_for(forced.device_kind) == "cuda"
    with pytest.raises(ValueError, match="python and rollout.vllm.command both"):
        RolloutConfig.model_validate(
            {"engine": "vllm", "vllm": {"model": "/m", "python": "/p", "command": ["vllm", "serve"]}}
        )


async def test_a_completion_streams_the_checkpoints_greedy_tokens_with_their_logprobs(store: Path) -> None:
    import transformers

    fake = await start_fake()
    engine = fake.engine("a")
    await engine.start()
    try:
        out = await engine.generate(request(max_tokens=12))
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir()), dtype=torch.float32)
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert out.token_ids == expected[0, len(PROMPT) :].tolist()
        assert out.finish_reason == "length" and out.versions == [0] * 12
        assert all(lp <= 0 and lp == lp for lp in out.logprobs) and len(out.logprobs) == 12
        wrong = VLLMEngine("w", "gpu0-w", fake.url, api_key="not-the-key-000000", start_timeout_s=30)
        await wrong.start()
        with pytest.raises(Unavailable, match="401"):
            await wrong.generate(request())
        await wrong.close()
    finally:
        await engine.close()
        await fake.stop()


async def test_a_published_version_reaches_vllm_by_hf_names_and_a_forged_one_is_refused(store: Path) -> None:
    fake = await start_fake()
    engine = fake.engine("a")
    await engine.start()
    try:
        before = await engine.generate(request())
        v1 = publish(store, 1, 0.05)
        await engine.load_weights(v1)
        assert engine.weight_version == 1 and not fake.state.paused
        params = dict(fake.state.model.named_parameters())
        for name, tensor in hf_tensors(v1).items():
            assert torch.equal(params[name], tensor), name
        after = await engine.generate(request())
        assert after.versions == [1] * 12 and after.logprobs != before.logprobs
        assert fake.state.record["rpcs"][-1] == "gyre_load_weights"
        v2 = publish(store, 2, 0.05)
        forged = common_pb2.WeightVersion(version=2, uri=v2.uri, sha256="0" * 64)
        with pytest.raises(Unavailable, match="sha256"):
            await engine.load_weights(forged)
        outside = common_pb2.WeightVersion(
            version=2, uri=(store.parent / "x.safetensors").as_uri(), sha256=v2.sha256
        )
        with pytest.raises(Unavailable, match="outside the weights store"):
            await engine.load_weights(outside)
        assert engine.weight_version == 1 and not fake.state.paused
        assert torch.equal(
            dict(fake.state.model.named_parameters())["lm_head.weight"], hf_tensors(v1)["lm_head.weight"]
        )
    finally:
        await engine.close()
        await fake.stop()


async def _migrate(temperature: float, store: Path) -> tuple[list[int], list[int], Fake, Fake, object]:
    """Start a request on fake A, drain A after >= 4 streamed tokens; returns (final ids, what A
    streamed, A, B, the completion)."""
    a, b = await start_fake(token_delay_s=0.05), await start_fake()
    router = Router()
    ea, eb = a.engine("a"), b.engine("b")
    await ea.start()
    await eb.start()
    await router.add_engine(ea)
    try:
        pending = asyncio.create_task(router.generate(request(max_tokens=16, temperature=temperature)))
        while ea.tokens_generated < 4:  # noqa: ASYNC110 - polling a counter
            await asyncio.sleep(0.01)
        await router.add_engine(eb)
        await router.remove_engine(ea.device_id)  # drained, then put to sleep (the device is lent)
        out = await pending
        (streamed,) = a.state.record["streamed"].values()
        return out.token_ids, streamed, a, b, out
    finally:
        await eb.close()


async def test_a_drained_greedy_request_ends_on_another_engine_with_exactly_the_unmoved_tokens(
    store: Path,
) -> None:
    moved, streamed, a, b, out = await _migrate(0.0, store)
    try:
        assert 4 <= len(streamed) < 16 and out.num_migrations == 1  # type: ignore[attr-defined]
        assert out.engine_ids == ["a", "b"]  # type: ignore[attr-defined]
        assert b.state.record["prompts"] == [PROMPT + streamed]  # prefilled from what A generated
        fresh = b.engine("c")
        await fresh.start()
        unmoved = await fresh.generate(request(max_tokens=16))
        await fresh.close()
        assert moved == unmoved.token_ids
        assert a.state.record["aborted"] == 1 and a.state.record["sleeps"] == [2]
    finally:
        await a.stop()
        await b.stop()


async def test_under_sampling_no_streamed_token_is_discarded_when_a_request_moves(store: Path) -> None:
    moved, streamed, a, b, _ = await _migrate(1.0, store)
    try:
        assert len(moved) == 16 and moved[: len(streamed)] == streamed
        assert b.state.record["prompts"] == [PROMPT + streamed]
    finally:
        await a.stop()
        await b.stop()


async def test_a_lent_server_sleeps_at_level_2_and_the_next_engine_wakes_it_with_the_current_weights(
    store: Path,
) -> None:
    fake = await start_fake()
    v1 = publish(store, 1, 0.05)
    first = fake.engine("a", initial_weights=v1)
    await first.start()
    reference = await first.generate(request())
    await first.close()  # the device goes to training
    assert fake.state.record["sleeps"] == [2] and fake.state.sleeping
    assert all(torch.isnan(p).all() for p in fake.state.model.parameters())  # memory really given up
    back = fake.engine("b", initial_weights=v1)
    await back.start()
    try:
        assert fake.state.record["wakes"] == [["weights"], ["kv_cache"]] and not fake.state.sleeping
        again = await back.generate(request())
        assert back.weight_version == 1 and again.token_ids == reference.token_ids
        assert again.logprobs == pytest.approx(reference.logprobs, abs=1e-6)
    finally:
        await back.close()
        await fake.stop()


async def test_the_supervisor_starts_vllm_serve_waits_for_health_and_restarts_it_when_it_dies(
    tmp_path: Path,
) -> None:
    spec = VLLMServerSpec(
        model=tiny_qwen2_dir(), port=0, api_key=KEY, gpus=(0,), weights_store=tmp_path,
        command=(sys.executable, "-m", "tests.helpers.fake_vllm", "serve"),
    )  # fmt: skip
    from gyre.embedded.server import free_port

    spec = VLLMServerSpec(**{**spec.__dict__, "port": free_port()})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    servers = VLLMServers(
        {"gpu0-0": spec}, tmp_path / "logs", start_timeout_s=120, backoff_s=0.1, base_env=env
    )
    await servers.start()
    watch = asyncio.create_task(servers.watch(poll_s=0.2))
    try:
        engine = VLLMEngine("a", "gpu0-0", spec.url, api_key=KEY, start_timeout_s=120)
        await engine.start()
        assert (await engine.generate(request(max_tokens=4))).token_ids
        await engine.close()
        first = servers.servers["gpu0-0"].proc
        assert first is not None
        os.killpg(first.pid, signal.SIGKILL)
        while servers.servers["gpu0-0"].restarts == 0 or not servers.servers["gpu0-0"].healthy.is_set():  # noqa: ASYNC110
            assert not watch.done(), watch
            await asyncio.sleep(0.2)
        assert servers.servers["gpu0-0"].proc is not first
        engine = VLLMEngine("b", "gpu0-0", spec.url, api_key=KEY, start_timeout_s=120)
        await engine.start()
        assert (await engine.generate(request(max_tokens=4))).token_ids
        await engine.close()
    finally:
        watch.cancel()
        servers.stop(5)
    bad = VLLMServerSpec(**{**spec.__dict__, "extra_args": ("--no-such-flag",)})
    with pytest.raises(Unavailable, match="exited"):
        await VLLMServers({"gpu0-0": bad}, tmp_path / "logs", start_timeout_s=120, base_env=env).start()


def test_the_rollout_config_names_the_moved_vllm_key_and_needs_a_model_to_serve() -> None:
    from services.rollout.config import RolloutConfig

    with pytest.raises(ValueError, match=r"rollout.vllm_urls is now rollout.vllm.urls"):
        RolloutConfig.model_validate({"engine": "vllm", "vllm_urls": ["http://x"]})
    with pytest.raises(ValueError, match="rollout.vllm.model"):
        RolloutConfig.model_validate({"engine": "vllm"})
    with pytest.raises(ValueError, match="one URL per device"):
        RolloutConfig.model_validate({"engine": "vllm", "num_devices": 2, "vllm": {"urls": ["http://x"]}})
    cfg = RolloutConfig.model_validate(
        {"engine": "vllm", "vllm": {"model": "/models/p", "tensor_parallel_size": 2}}
    )
    assert cfg.vllm.tensor_parallel_size == 2 and cfg.vllm.command == ["vllm", "serve"]
    with pytest.raises(InvalidArgument):
        from services.rollout.engines.vllm_worker import path_in_store

        path_in_store("http://example.com/v1.safetensors", Path("/tmp"))


def test_a_server_that_dies_while_starting_is_reported_with_the_end_of_its_log(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from services.rollout.engines.vllm_server import wait_healthy

    log = tmp_path / "vllm-gpu-a.log"
    log.write_text("x" * 5000 + "\nvllm serve: error: unrecognized arguments: --bogus\n")
    dead = SimpleNamespace(returncode=2, log_path=log)
    with pytest.raises(Unavailable) as err:
        asyncio.run(wait_healthy("http://127.0.0.1:9", 5.0, dead))  # type: ignore[arg-type]
    assert "exited with 2" in str(err.value) and "unrecognized arguments: --bogus" in str(err.value)
    assert len(str(err.value)) < 2500  # the tail, not the whole log
    gone = SimpleNamespace(returncode=1, log_path=tmp_path / "removed" / "vllm.log")
    with pytest.raises(Unavailable, match="no log"):
        asyncio.run(wait_healthy("http://127.0.0.1:9", 5.0, gone))  # type: ignore[arg-type]
