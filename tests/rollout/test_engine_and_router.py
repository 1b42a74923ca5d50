"""Torch engine (tiny gyre.model on CPU) and router: batching, deterministic sampling, live migration."""

import asyncio

import pytest
import torch

from gyre.model import ModelConfig
from services.rollout.engines.base import GenerationRequest, Sampling
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.router import Router

CFG = ModelConfig.model_validate({})


async def started(engine_id: str, device_id: str) -> TorchEngine:
    engine = TorchEngine(engine_id, device_id, CFG, init_seed=7)
    await engine.start()
    return engine


def request(i: int, max_tokens: int = 24, temperature: float = 0.0) -> GenerationRequest:
    prompt = [257, *(((i * 37 + k * 11) % 250) for k in range(5 + i % 7)), 261]
    return GenerationRequest(
        f"r{i}",
        prompt,
        Sampling(temperature=temperature, max_tokens=max_tokens, seed=100 + i, stop_token_ids=()),
    )


async def test_batched_engine_matches_one_request_at_a_time() -> None:
    engine = await started("e0", "cpu0-0")
    try:
        together = await asyncio.gather(*(engine.generate(request(i)) for i in range(6)))
        alone = [await engine.generate(request(i)) for i in range(6)]
        assert [c.token_ids for c in together] == [c.token_ids for c in alone]
        assert all(c.finish_reason == "length" and len(c.token_ids) == 24 for c in together)
        assert all(len(c.logprobs) == len(c.versions) == 24 for c in together)
    finally:
        await engine.close()


async def test_sampling_resumed_at_a_token_offset_continues_identically() -> None:
    engine = await started("e0", "cpu0-0")
    try:
        req = request(3, max_tokens=20, temperature=1.0)
        full = await engine.generate(req)
        head = full.token_ids[:8]
        tail = await engine.generate(req.resumed(head))
        assert head + tail.token_ids == full.token_ids
        assert tail.logprobs == pytest.approx(full.logprobs[8:], abs=1e-4)
    finally:
        await engine.close()


async def test_migration_mid_generation_is_token_exact_against_one_engine() -> None:
    reference = await started("ref", "cpu9-0")
    expected = [await reference.generate(request(i, max_tokens=48)) for i in range(8)]
    await reference.close()

    router = Router()
    for d in range(2):
        await router.add_engine(await started(f"e{d}", f"cpu0-{d}"))
    calls = [asyncio.create_task(router.generate(request(i, max_tokens=48))) for i in range(8)]
    # Take both devices away mid-generation, with a gap where no engine exists (requests park).
    while sum(e.tokens_generated for e in router.engines.values()) < 40:  # noqa: ASYNC110 - polling a counter
        await asyncio.sleep(0.005)
    await router.remove_engine("cpu0-0")
    await router.remove_engine("cpu0-1")
    await asyncio.sleep(0.05)
    await router.add_engine(await started("e2", "cpu0-2"))
    got = await asyncio.gather(*calls)
    for engine in list(router.engines):
        await router.remove_engine(engine)

    assert router.stats.migrations >= 1
    assert sum(c.num_migrations for c in got) == router.stats.migrations
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for g, e in zip(got, expected, strict=True):
        assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)
        assert g.finish_reason == "length" and len(g.versions) == 48
    assert any(len(c.engine_ids) > 1 for c in got)


class _Loaded:
    """An engine as the router's choice sees it (state, version, load); a stand-in for the choice
    alone: no request is sent to it."""

    def __init__(self, engine_id: str, active: int, context: int) -> None:
        from services.rollout.engines.base import EngineState

        self.engine_id, self.num_active, self.context_tokens = engine_id, active, context
        self.state, self.weight_version = EngineState.SERVING, 0


async def test_a_request_goes_to_the_engine_whose_decoding_holds_the_least_context() -> None:
    router = Router()
    # e0 decodes one long context, e1 three short ones: e1's decode step is the cheaper to join.
    router.engines = {"d0": _Loaded("e0", 1, 9_000), "d1": _Loaded("e1", 3, 600)}  # type: ignore[dict-item]
    assert (await router._pick()).engine_id == "e1"
    router.engines["d1"] = _Loaded("e1", 3, 9_000)  # type: ignore[assignment]
    assert (await router._pick()).engine_id == "e0"  # equal context: fewer active requests
    router.engines["d1"] = _Loaded("e1", 1, 9_000)  # type: ignore[assignment]
    assert (await router._pick()).engine_id == "e0"  # a full tie: the lower engine id


def test_closing_a_torch_engine_returns_cached_device_memory_only_where_there_is_a_cuda_device() -> None:
    from services.rollout.engines.torch_engine import release_device_memory

    assert release_device_memory("cpu") is False  # nothing cached on the host to give back
    assert release_device_memory("cuda:0") is torch.cuda.is_available()
