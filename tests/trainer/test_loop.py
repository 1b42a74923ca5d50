"""The step loop against a gRPC Trajectory server, resume after a crash, weights events on real NATS.

The Trajectory server here is a scripted stand-in (the outermost edge for this test): it serves
prepared batches over the real PullBatch/AckBatch protocol and records acks and resumes.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import gyre.rpc
from gyre.bus import Bus, subjects
from gyre.v1 import events_pb2, trajectory_pb2, trajectory_pb2_grpc
from services.trainer.batch import to_chunk
from services.trainer.config import TrainerConfig
from services.trainer.data import TrajectoryBatchSource
from services.trainer.loop import Trainer
from tests.trainer.helpers import random_batch


class ScriptedTrajectory(trajectory_pb2_grpc.TrajectoryServicer):
    def __init__(self, num_batches: int) -> None:
        self.batches = {f"b{i}": random_batch(i, batch_id=f"b{i}") for i in range(num_batches)}
        self.order = list(self.batches)
        self.next = 0
        self.acked: list[str] = []
        self.received: list[str] = []
        self.resumed: list[str] = []

    async def PullBatch(self, request, context):
        if request.resume_batch_id:
            self.resumed.append(request.resume_batch_id)
            batch = self.batches[request.resume_batch_id]
        elif self.next < len(self.order):
            batch = self.batches[self.order[self.next]]
            self.next += 1
        else:
            await asyncio.sleep(0.01)
            return
        trees = batch.tree_ranges()
        yield to_chunk(batch.select_trees(trees[:1]), 0, False)
        yield to_chunk(batch.select_trees(trees[1:]), 1, True)

    async def AckBatch(self, request, context):
        if request.received:  # a receipt (the batch arrived whole), not a training ack
            self.received.append(request.batch_id)
        else:
            self.acked.append(request.batch_id)
        return trajectory_pb2.AckBatchResponse()


async def _serve(servicer):
    server, port = gyre.rpc.create_server()
    trajectory_pb2_grpc.add_TrajectoryServicer_to_server(servicer, server)
    await server.start()
    return server, port


def _config(port: int) -> TrainerConfig:
    return TrainerConfig(trajectory_address=f"127.0.0.1:{port}", checkpoint_every=2, lr=1e-2, pull_wait_s=0)


async def _trainer(cfg, run_dir, port, published):
    async def sink(weights, metrics):
        published.append((weights, metrics))

    source = TrajectoryBatchSource(f"127.0.0.1:{port}", "r", "trainer-0", 1024, 0)
    return Trainer(cfg, run_dir, source, sink, seed=0)


@pytest.mark.integration
async def test_crashed_trainer_resumes_without_training_a_batch_twice(tmp_path):
    servicer = ScriptedTrajectory(4)
    server, port = await _serve(servicer)
    try:
        published: list = []
        first = await _trainer(_config(port), tmp_path / "run", port, published)
        await first.run(max_steps=3)  # checkpoint at step 2; b2 trained but not covered, then "crash"
        assert servicer.acked == ["b0", "b1"]
        second = await _trainer(_config(port), tmp_path / "run", port, published)
        assert second.state.step == 2 and second.replay == ["b2"]
        await second.run(max_steps=4)
        assert servicer.resumed == ["b2"]
        assert servicer.acked == ["b0", "b1", "b2", "b3"]
        assert second.state.trained_batch_ids == ["b0", "b1", "b2", "b3"]
        versions = [w.version for w, _ in published]
        assert versions == [1, 2, 3, 4, 5]  # no version number reused for different weights

        reference_servicer = ScriptedTrajectory(4)
        ref_server, ref_port = await _serve(reference_servicer)
        reference = await _trainer(_config(ref_port), tmp_path / "ref", ref_port, [])
        await reference.run(max_steps=4)
        await ref_server.stop(None)
        for a, b in zip(second.model.parameters(), reference.model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    finally:
        await server.stop(None)


@pytest.mark.integration
async def test_weights_published_event_carries_version_uri_and_digest(tmp_path, nats_url):
    from gyre.model import load_weights
    from services.trainer.service import publish_weights_event

    servicer = ScriptedTrajectory(1)
    server, port = await _serve(servicer)
    bus = await Bus.connect(nats_url, name="trainer-test")
    await bus.ensure_streams()
    try:
        cfg = _config(port)
        source = TrajectoryBatchSource(f"127.0.0.1:{port}", "evt", "trainer-0", 1024, 0)
        trainer = Trainer(cfg, tmp_path, source, lambda w, m: publish_weights_event(bus, "evt", w, m), seed=0)
        await trainer.run(max_steps=1)
        received = []
        async for msg in bus.tail(subjects.weights("evt"), events_pb2.WeightsPublishedEvent, from_start=True):
            received.append(msg)
            break
        event = received[0]
        assert event.weights.version == 1 and event.weights.uri.startswith("file://")
        assert "loss" in event.metrics
        load_weights(trainer.model, event.weights.uri[len("file://") :], expected_sha256=event.weights.sha256)
    finally:
        await bus.close()
        await server.stop(None)
