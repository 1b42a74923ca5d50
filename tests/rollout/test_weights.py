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
from services.rollout.weights import WeightsRefused, WeightSwapper

CFG = ModelConfig.model_validate({})


def weights_file(tmp_path: Path, version: int) -> common_pb2.WeightVersion:
    """Version `version` written into the weights store `tmp_path` (distinct random weights)."""
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
    swapper = WeightSwapper(router, store=tmp_path)
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
    with pytest.raises(WeightsRefused, match="sha256"):
        await WeightSwapper(router, store=tmp_path).apply(bad)
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
    await WeightSwapper(router, store=tmp_path).apply(weights_file(tmp_path, 1))
    out = await asyncio.wait_for(held, 30)
    assert out.versions == [1, 1, 1, 1]
    await router.remove_engine("cpu0-0")
    with pytest.raises(TimeoutError):  # no engine left: the request parks instead of failing
        await asyncio.wait_for(router.generate(req(1)), 0.2)


async def started_engine() -> tuple[Router, TorchEngine]:
    router = Router(max_staleness=0)
    engine = TorchEngine("e0", "cpu0-0", CFG)
    await engine.start()
    await router.add_engine(engine)
    return router, engine


async def test_weights_outside_the_store_are_refused_and_nothing_is_loaded(tmp_path: Path) -> None:
    store, elsewhere = tmp_path / "weights", tmp_path / "elsewhere"
    store.mkdir()
    elsewhere.mkdir()
    router, engine = await started_engine()
    swapper = WeightSwapper(router, store=store)
    outside = weights_file(elsewhere, 1)  # a genuine weights file with its right sha256, but outside
    (store / "link.safetensors").symlink_to(outside.uri.removeprefix("file://"))
    forged = [
        outside,
        common_pb2.WeightVersion(version=1, uri="file:///etc/passwd", sha256=outside.sha256),
        common_pb2.WeightVersion(version=1, uri=f"file://{store}/../elsewhere/v1.safetensors", sha256=outside.sha256),
        common_pb2.WeightVersion(version=1, uri=f"file://{store}/link.safetensors", sha256=outside.sha256),
        common_pb2.WeightVersion(version=1, uri=f"file://{store}/%2e%2e/elsewhere/v1.safetensors", sha256=outside.sha256),
        common_pb2.WeightVersion(version=1, uri=f"https://example.org/{store}/v1.safetensors", sha256=outside.sha256),
    ]  # fmt: skip
    try:
        for weights in forged:
            with pytest.raises(WeightsRefused, match="store|plain path|file://"):
                await swapper.apply(weights)
        assert swapper.refused == {"uri": len(forged)}
        assert engine.weight_version == 0 and swapper.latest is None
        assert router.latest_published == 0  # the staleness floor never moved: generation goes on
        out = await asyncio.wait_for(router.generate(req(2)), 30)
        assert out.versions == [0, 0]
    finally:
        await router.remove_engine("cpu0-0")


async def test_weights_without_sha256_or_absurdly_ahead_are_refused(tmp_path: Path) -> None:
    router, engine = await started_engine()
    swapper = WeightSwapper(router, store=tmp_path, max_version_ahead=10)
    good = weights_file(tmp_path, 1)
    try:
        no_sha = common_pb2.WeightVersion(version=1, uri=good.uri)
        with pytest.raises(WeightsRefused, match="sha256"):
            await swapper.apply(no_sha)
        far = common_pb2.WeightVersion(version=10**9, uri=good.uri, sha256=good.sha256)
        with pytest.raises(WeightsRefused, match="ahead"):
            await swapper.apply(far)
        assert swapper.refused == {"sha256": 1, "version": 1} and engine.weight_version == 0
        assert router.latest_published == 0
        await swapper.apply(good)
        assert engine.weight_version == 1 and swapper.num_refused == 2
    finally:
        await router.remove_engine("cpu0-0")


async def test_a_forged_event_does_not_take_down_the_real_one_in_the_same_batch(tmp_path: Path) -> None:
    router, engine = await started_engine()
    swapper = WeightSwapper(router, store=tmp_path)
    real = weights_file(tmp_path, 2)
    forged = common_pb2.WeightVersion(version=10**9, uri="file:///etc/passwd", sha256="0" * 64)
    try:
        await swapper.handle(
            [events_pb2.WeightsPublishedEvent(weights=w) for w in (real, forged)]
        )  # no exception: a bus handler acks refused events (counted), it does not redeliver them
        assert engine.weight_version == 2 and swapper.refused == {"version": 1}
    finally:
        await router.remove_engine("cpu0-0")
