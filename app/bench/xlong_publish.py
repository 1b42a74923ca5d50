"""The rollout side of `gyre bench xlong`, run as its own process: long executions through the
production step sink (`python -m app.bench.xlong_publish --nats URL --context N ...`).

Every call of every execution is handed, with its full prompt, to the rollout's `BusStepSink`
(services/rollout/steps.py: gyre.bus.steps.StepCompactor, parts under `step_max_bytes`), and each
execution's end event after its calls, as the agent loop does. The sink's publishing loop starts only
on a line on stdin, so the queue is filled first (making million-token prompts is the agent's work,
not what the bench measures) and then drained onto NATS: what the trajectory service ingests is
exactly what rollout publishes. Prints two JSON lines on stdout: the workload once the queue is full,
then the wire figures once every message is stored on its stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from google.protobuf.message import Message

from gyre.bus import Bus
from gyre.v1 import events_pb2
from services.rollout.steps import BusStepSink
from services.trajectory.synthetic import LongConfig, long_end_event, long_executions, step_event

RUN_ID = "xlong"


class _MeasuredPublisher:
    """The bus's publisher, noting the size of every step message it is handed (parts included)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.max_step_bytes = 0
        self.step_messages = 0

    async def publish(self, subject: str, msg: Message, *, msg_id: str | None = None) -> None:
        if isinstance(msg, events_pb2.StepEvent):
            self.max_step_bytes = max(self.max_step_bytes, msg.ByteSize())
            self.step_messages += 1
        await self.inner.publish(subject, msg, msg_id=msg_id)

    async def flush(self, timeout_s: float = 30.0) -> None:
        await self.inner.flush(timeout_s)


class _MeasuredBus:
    """A Bus whose publishers are measured (everything else is the Bus itself)."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self.publishers: list[_MeasuredPublisher] = []

    def publisher(self, max_pending: int = 10_000, **kw: Any) -> _MeasuredPublisher:
        p = _MeasuredPublisher(self._bus.publisher(max_pending, **kw))
        self.publishers.append(p)
        return p

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bus, name)


async def publish(args: argparse.Namespace) -> None:
    cfg = LongConfig(
        context_tokens=args.context, group_size=args.group_size, num_groups=args.groups, seed=args.seed
    )
    bus = await Bus.connect(args.nats, name="xlong-rollout")
    measured = _MeasuredBus(bus)
    sink = BusStepSink(measured, max_buffer=1 << 22, max_step_bytes=args.step_max_bytes)  # type: ignore[arg-type]
    (publisher,) = measured.publishers
    t0 = time.perf_counter()
    num_steps = flat = prompt_tokens = 0
    calls_per_execution = []
    for ex in long_executions(cfg):
        n = 0
        for c in ex.calls():
            await sink.publish_step(step_event(RUN_ID, c))
            n += 1
            flat += len(c.prompt) + len(c.completion)
            prompt_tokens += len(c.prompt)
        await sink.publish_execution(long_end_event(RUN_ID, ex, n))
        calls_per_execution.append(n)
        num_steps += n
    prepared = {
        "num_steps": num_steps,
        "num_executions": len(calls_per_execution),
        "calls_per_execution_max": max(calls_per_execution),
        "flat_tokens": flat,
        "flat_prompt_tokens": prompt_tokens,
        "step_parts_extra": sink.num_parts,
        "prepare_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(prepared), flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    t0 = time.perf_counter()
    sink.start()
    await sink.flush()
    done = {
        "publish_s": round(time.perf_counter() - t0, 3),
        "wire_bytes": sink.num_wire_bytes,
        "step_messages": publisher.step_messages,
        "max_step_message_bytes": publisher.max_step_bytes,
        "unpublishable": sink.num_unpublishable,
        "invalid": sink.num_invalid,
        "retried_batches": sink.num_retried_batches,
    }
    await sink.close()
    await bus.close()
    print(json.dumps(done), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench.xlong_publish", description=__doc__.split("\n")[0])
    p.add_argument("--nats", required=True)
    p.add_argument("--context", type=int, required=True, help="context tokens each execution reaches")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-max-bytes", type=int, default=1 << 20)
    asyncio.run(publish(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
