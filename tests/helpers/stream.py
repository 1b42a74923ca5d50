"""Read a run's events back from JetStream after the run (full payloads: events.jsonl keeps summaries)."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from google.protobuf.message import Message

from gyre.bus import Bus
from gyre.v1 import events_pb2

M = TypeVar("M", bound=Message)


async def _read(nats_url: str, subject: str, msg_type: type[M], n: int, timeout_s: float) -> list[M]:
    bus = await Bus.connect(nats_url, name="test-reader")
    out: list[M] = []

    async def run() -> None:
        async for ev in bus.tail(subject, msg_type, from_start=True):
            out.append(ev)
            if len(out) == n:
                return

    try:
        await asyncio.wait_for(run(), timeout_s)
    finally:
        await bus.close()
    return out


def read_stream(nats_url: str, subject: str, msg_type: type[M], n: int, timeout_s: float = 60.0) -> list[M]:
    """The first `n` messages on `subject`, replayed from the start of its stream (TimeoutError if fewer)."""
    return asyncio.run(_read(nats_url, subject, msg_type, n, timeout_s))


def expanded_prompts(steps: list[events_pb2.StepEvent]) -> dict[int, list[int]]:
    """call_seq -> the full prompt of each step of one execution (compact steps, which travel as a
    reference to an earlier call plus new tokens, rebuilt and checked as the services do)."""
    from services.rollout.resume import full_prompt

    earlier: dict[int, events_pb2.StepEvent] = {}
    out: dict[int, list[int]] = {}
    for step in sorted(steps, key=lambda s: s.call_seq):
        prompt = full_prompt(step, earlier)
        assert prompt is not None, f"call {step.call_seq}: its compact prompt does not rebuild"
        full = events_pb2.StepEvent()
        full.CopyFrom(step)
        full.ClearField("prompt_token_ids")
        full.prompt_token_ids.extend(prompt)
        earlier[step.call_seq] = full
        out[step.call_seq] = prompt
    return out
