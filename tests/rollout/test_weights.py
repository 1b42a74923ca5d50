"""Weight hot-swap over NATS, checksum refusal and the staleness bound."""

import asyncio
from pathlib import Path

import pytest

from gyre.bus import Bus, subjects
from gyre.model import ModelConfig, build_model, save_weights
from gyre.v1 import common_pb2, events_pb2
from services.rollout.engines.base import GenerationRequest, Sampling
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.router import Router
from services.rollout.weights import WeightSwapper

CFG = ModelConfig.model_validate({})


def weights_file(tmp_path: Path, version: int) -> common_pb2.WeightVersion:
    path = tmp_path / f"v{version}.safetensors"
    sha = save_weights(build_model(CFG, seed=1000 + version), path)
    return common_pb2.WeightVersion(version=version, uri=f"file://{path}", sha256=sha)


def req(n: int = 32) -> GenerationRequest:
    return GenerationRequest("w", [257, 72, 105, 261], Sampling(max_tokens=n, stop_token_ids=()))


async def test_published_weights_are_loaded_between_decode_steps_without_aborting(
    nats_url: str, tmp_path: Path
) -> None:
    run_id = "weights-test"
    bus = await Bus.connect(nats_url, name="rollout-test")
    await bus.ensure_streams()
    router = Router()
    engine = TorchEngine("e0", "cpu0-0", CFG)
    await engine.start()
    await router.add_engine(engine)
    swapper = WeightSwapper(router)
    consumer = await bus.consume(
        subjects.weights(run_id),
        events_pb2.WeightsPublishedEvent,
        swapper.handle,
        durable="rollout-weights-test",
    )
    try:
        long_call = asyncio.create_task(router.generate(req(400)))
        while engine.tokens_generated < 5:  # noqa: ASYNC110 - polling a counter
            await asyncio.sleep(0.005)
        w1 = weights_file(tmp_path, 1)
        await bus.publish(
            subjects.weights(run_id),
            events_pb2.WeightsPublishedEvent(event_id="weights.w.1", run_id=run_id, weights=w1),
            msg_id="weights.w.1",
        )
        out = await long_call
        assert out.finish_reason == "length" and len(out.versions) == 400
        assert out.versions[0] == 0 and out.versions[-1] == 1 and out.versions == sorted(out.versions)
        assert engine.weight_version == 1 and swapper.latest is not None
    finally:
        await consumer.stop()
        await router.remove_engine("cpu0-0")
        await bus.close()


async def test_weights_with_a_wrong_checksum_are_refused(tmp_path: Path) -> None:
    router = Router()
    engine = TorchEngine("e0", "cpu0-0", CFG)
    await engine.start()
    await router.add_engine(engine)
    bad = weights_file(tmp_path, 1)
    bad.sha256 = "0" * 64
    await WeightSwapper(router).apply(bad)
    assert engine.weight_version == 0
    await router.remove_engine("cpu0-0")


async def test_staleness_bound_holds_new_generations_until_fresh_weights_load(tmp_path: Path) -> None:
    router = Router(max_staleness=0)
    engine = TorchEngine("e0", "cpu0-0", CFG)
    await engine.start()
    await router.add_engine(engine)
    await router.note_published(1)  # newer weights exist but the engine has not loaded them
    held = asyncio.create_task(router.generate(req(4)))
    await asyncio.sleep(0.2)
    assert not held.done() and engine.tokens_generated == 0
    await WeightSwapper(router).apply(weights_file(tmp_path, 1))
    out = await asyncio.wait_for(held, 30)
    assert out.versions == [1, 1, 1, 1]
    await router.remove_engine("cpu0-0")
    with pytest.raises(TimeoutError):  # no engine left: the request parks instead of failing
        await asyncio.wait_for(router.generate(req(1)), 0.2)
