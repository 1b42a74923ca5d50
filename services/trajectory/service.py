"""The trajectory service: NATS consumers, the gRPC Trajectory servicer and the scoring/batching loop.

Boundaries (errors handled once, here):
- NATS ``gyre.steps.<run>.*`` and ``gyre.executions.<run>.*``: durable consumers; a batch is
  committed to Postgres before the handler returns (then the bus acks it). Invalid events are
  stored in ``traj_rejections`` with the reason and acked (redelivering them cannot help); a
  failing commit raises, so the bus naks and redelivers the batch.
- gRPC: every method goes through ``gyre.rpc.error_boundary`` (InvalidArgument -> INVALID_ARGUMENT,
  NotFound -> NOT_FOUND, PermissionDenied -> PERMISSION_DENIED, ...).
- Trust: every step passes ``StepGate`` (services/trajectory/validation.py) before ingest — invalid
  ones go to the dead-letter stream and are never stored; only the registered trainer pulls and
  acks batches; a PullBatch version is clamped to the published weights (a durable consumer of
  ``gyre.weights.<run>`` tracks the newest).
- The poll loop dies loudly (``rt.spawn``): the service then stops with exit code 1.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import grpc

from gyre import rpc
from gyre.bus import Bus, Consumer, subjects
from gyre.config import CommonConfig
from gyre.errors import Unavailable
from gyre.service import Runtime, Service
from gyre.v1 import events_pb2, trajectory_pb2, trajectory_pb2_grpc, waits_pb2
from services.trajectory.config import TrajectoryConfig
from services.trajectory.core import TrajectoryCore, typed_stats
from services.trajectory.drops import DropAnnouncer
from services.trajectory.ingest import STEPS_MAX_NAK_DELAY_S
from services.trajectory.validation import MAX_PULL_WAIT_S, StepGate
from services.trajectory.waits import trajectory_waits

log = logging.getLogger("gyre.trajectory")


class TrajectoryServicer(trajectory_pb2_grpc.TrajectoryServicer):
    def __init__(self, core: TrajectoryCore, gate: StepGate | None = None) -> None:
        self.core = core
        self.gate = gate if gate is not None else StepGate(core.run_id, core.cfg)

    @rpc.error_boundary
    async def IngestSteps(  # noqa: N802 (gRPC method name)
        self, request_iterator: AsyncIterator[events_pb2.StepEvent], context: grpc.aio.ServicerContext
    ) -> trajectory_pb2.IngestSummary:
        total = trajectory_pb2.IngestSummary()
        pending: list[events_pb2.StepEvent] = []

        async def flush() -> None:
            gated = await self.gate.split(pending)
            total.num_received += len(gated.refused) + len(gated.early)
            total.num_rejected += len(gated.refused)
            total.num_waiting += len(gated.early)  # resend them once their weights version is published
            total.errors.extend(p.reason for _, p in gated.refused[: max(0, 100 - len(total.errors))])
            pending[:] = gated.valid
            s = await self.core.ingest.ingest_steps(pending)
            total.num_received += s.num_received
            total.num_stored += s.num_stored
            total.num_duplicates += s.num_duplicates
            total.num_rejected += s.num_rejected
            total.num_waiting += s.num_waiting
            total.errors.extend(s.errors[: max(0, 100 - len(total.errors))])
            pending.clear()

        async for step in request_iterator:
            pending.append(step)
            if len(pending) >= self.core.cfg.ingest_batch_size:
                await flush()
        if pending:
            await flush()
        return total

    @rpc.error_boundary
    async def PullBatch(  # noqa: N802
        self, request: trajectory_pb2.PullBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trajectory_pb2.BatchChunk]:
        self.gate.check_consumer(request.consumer)
        self.gate.check_pull(request)
        if request.resume_batch_id:
            b = await asyncio.to_thread(self.core.store.get_batch, request.resume_batch_id)
            if b is not None:
                self.gate.check_owner(request.consumer, b.consumer, request.resume_batch_id)
        checked = trajectory_pb2.PullBatchRequest()
        checked.CopyFrom(request)
        checked.current_version = self.gate.clamp_version(request.current_version)
        checked.wait_s = min(request.wait_s, MAX_PULL_WAIT_S)
        handout = await self.core.batching.pull(checked)
        if handout is None:
            return
        complete = False
        try:
            async for chunk in handout.chunks():  # read and decoded one at a time from Postgres
                yield chunk
            complete = True
        finally:  # a broken stream (trainer gone, cancelled) gives the batch back at once
            await self.core.batching.sent(handout, complete)

    @rpc.error_boundary
    async def AckBatch(  # noqa: N802
        self, request: trajectory_pb2.AckBatchRequest, context: grpc.aio.ServicerContext
    ) -> trajectory_pb2.AckBatchResponse:
        self.gate.check_consumer(request.consumer)
        b = await asyncio.to_thread(self.core.store.get_batch, request.batch_id)
        if b is not None:
            self.gate.check_owner(request.consumer, b.consumer, request.batch_id)
        await self.core.batching.ack(request)
        return trajectory_pb2.AckBatchResponse()

    @rpc.error_boundary
    async def ExportExecution(  # noqa: N802
        self, request: trajectory_pb2.ExportExecutionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trajectory_pb2.ExportExecutionResponse]:
        # One call per message, each built when it is sent: memory and message size O(one call).
        for message in self.core.export(request.execution_id):
            yield message
            await asyncio.sleep(0)  # let ingest run between calls of a long execution

    @rpc.error_boundary
    async def GetStats(  # noqa: N802
        self, request: trajectory_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> trajectory_pb2.GetStatsResponse:
        values = await self.core.stats()
        values.update({k: float(v) for k, v in self.gate.counters.items()})
        values["latest_weights_version"] = float(self.gate.latest_version)
        return trajectory_pb2.GetStatsResponse(
            values=values, stats=typed_stats(values, max(0, int(self.gate.latest_version)))
        )


class TrajectoryService(Service):
    name: ClassVar[str] = "trajectory"

    def __init__(self, common: CommonConfig, cfg: TrajectoryConfig) -> None:
        self.common = common
        self.cfg = cfg
        self.core: TrajectoryCore | None = None
        self.gate: StepGate | None = None
        self.consumers: list[Consumer[Any]] = []
        self.bus: Bus | None = None
        self.drops = DropAnnouncer(common.run_id)
        self._stopping = asyncio.Event()

    async def start(self, rt: Runtime) -> None:
        self.bus = rt.bus
        core = self.core = TrajectoryCore(self.common.run_id, self.cfg, rt.engine)
        await asyncio.to_thread(core.load)
        run_id = self.common.run_id

        async def announce(ev: events_pb2.BatchReadyEvent) -> None:
            await rt.bus.publish(subjects.paths_batch(run_id), ev, msg_id=ev.event_id)

        core.batching.announce = announce

        async def dead_letter(subject: str, payload: bytes, type_name: str, code: str, reason: str) -> None:
            await rt.bus.dead_letter(subject, payload, type_name, code, reason, service=self.name)

        gate = self.gate = StepGate(run_id, self.cfg, dead_letter)

        async def unresolved(step: events_pb2.StepEvent, reason: str) -> None:
            kept = events_pb2.StepEvent()
            kept.CopyFrom(step)
            if kept.ByteSize() > rt.bus.max_payload // 2:  # too large to dead-letter whole: ids and reason
                for name in (
                    "prompt_token_ids",
                    "completion_token_ids",
                    "completion_logprobs",
                    "completion_versions",
                ):
                    kept.ClearField(name)  # type: ignore[arg-type]
                reason += " (token lists left out of this dead letter: too large)"
            subject = subjects.steps(step.run_id, step.task_id)
            await dead_letter(
                subject, kept.SerializeToString(), "gyre.v1.StepEvent", "unresolved_reference", reason
            )

        core.ingest.on_unresolved = unresolved
        trajectory_pb2_grpc.add_TrajectoryServicer_to_server(TrajectoryServicer(core, gate), rt.server)
        run = self.common.run_id
        durable = self.cfg.durable_name
        await self._seed_latest_weights(rt.bus, gate, run)
        # Newest published weights version: bounds step versions and PullBatch's current_version.
        self.consumers.append(
            await rt.bus.consume(
                subjects.weights(run),
                events_pb2.WeightsPublishedEvent,
                self._on_weights,
                durable=f"{durable}-{run}-weights",
            )
        )
        self.consumers.append(
            await rt.bus.consume(
                subjects.executions(run, "*"),
                events_pb2.ExecutionEvent,
                self._on_executions,
                durable=f"{durable}-{run}-executions",
                batch_size=self.cfg.ingest_batch_size,
            )
        )
        # One fetcher: steps arrive in stream order, so a compact step's base call is always stored
        # before it (two fetchers on the durable reorder batches, and compact steps then wait for
        # redelivery again and again; a bench run with two stayed stuck for minutes).
        self.consumers.append(
            await rt.bus.consume(
                subjects.steps(run, "*"),
                events_pb2.StepEvent,
                self._on_steps,
                durable=f"{durable}-{run}-steps",
                max_nak_delay_s=STEPS_MAX_NAK_DELAY_S,
                batch_size=self.cfg.ingest_batch_size,
                fetch_max_bytes=self.cfg.ingest_fetch_max_bytes,
            )
        )
        rt.spawn(self._poll_loop(), name="trajectory-poll")

    @staticmethod
    async def _seed_latest_weights(bus: Bus, gate: StepGate, run: str) -> None:
        """Start the gate at the newest weights version stored on the bus. A restarted service's
        durable weights consumer has acked every earlier event, so without this the gate would
        restart at 0 and dead-letter the rollout's current steps as 'version ahead'."""
        last = await bus.last(subjects.weights(run), events_pb2.WeightsPublishedEvent)
        if last is not None:
            gate.note_weights(last.weights.version)

    async def _on_weights(self, msgs: list[events_pb2.WeightsPublishedEvent]) -> None:
        assert self.gate is not None
        for ev in msgs:
            self.gate.note_weights(ev.weights.version)

    async def _on_steps(self, msgs: list[events_pb2.StepEvent]) -> asyncio.Future[None] | None:
        """Insert the batch; the consumer acks it when the returned commit completes, and hands over
        the next batch meanwhile (inserted in stream order, committed in the same order)."""
        assert self.core is not None and self.gate is not None
        gated = await self.gate.split(msgs)  # refused steps are dead-lettered (and acked) here
        summary, committed = await self.core.ingest.insert_steps(gated.valid)
        for err in summary.errors[:5]:
            log.warning("rejected step: %s", err)
        if not gated.early and not summary.num_waiting:
            return committed
        await committed
        if gated.early:
            # Not acked: redelivered after a delay, when the newer weights event has been seen.
            raise Unavailable(f"{len(gated.early)} steps carry a weights version not seen yet; retrying")
        # Not acked: JetStream redelivers the batch; what was stored now is then a duplicate.
        raise Unavailable(f"{summary.num_waiting} compact steps wait for their base call; retrying")

    async def _on_executions(self, msgs: list[events_pb2.ExecutionEvent]) -> None:
        assert self.core is not None and self.gate is not None
        # Invalid events are dead-lettered here and still handed to ingest, which refuses them too
        # and keeps them in traj_rejections (the run's own record, next to its trees).
        await self.gate.split_executions(msgs)
        await self.core.ingest.ingest_executions(msgs)

    async def poll_once(self) -> None:
        """Score ready groups and build announced batches, publishing their events."""
        assert self.core is not None and self.bus is not None
        run = self.common.run_id
        for ev in await self.core.scoring.score_ready_groups():
            await self.bus.publish(subjects.paths_scored(run), ev, msg_id=ev.event_id)
        while (ready := await self.core.batching.build_announced_batch()) is not None:
            await self.bus.publish(subjects.paths_batch(run), ready, msg_id=ready.event_id)
        # Groups that will never be trained give their admission slot back (services/trajectory/drops.py).
        for dropped in self.drops.new_drops(self.core.state):
            await self.bus.publish(subjects.paths_dropped(run), dropped, msg_id=dropped.event_id)
            self.drops.published(dropped.group_id)

    async def _poll_loop(self) -> None:
        while not self._stopping.is_set():
            await self.poll_once()
            try:
                await asyncio.wait_for(self._stopping.wait(), timeout=self.cfg.ready_poll_s)
            except TimeoutError:
                pass

    def waits(self) -> list[waits_pb2.Wait]:
        """Open groups and what holds them, scored groups not batched (services/trajectory/waits.py)."""
        return trajectory_waits(self.core.state, self.cfg.group_size) if self.core is not None else []

    async def stop(self) -> None:
        self._stopping.set()
        for c in self.consumers:
            await c.stop()
        self.consumers.clear()


def build(common: CommonConfig, cfg: TrajectoryConfig) -> TrajectoryService:
    return TrajectoryService(common, cfg)
