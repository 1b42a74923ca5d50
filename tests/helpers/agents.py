"""Scripted agents for tests of the rollout's admission: fakes at the outermost edge (they stand in
for an agent driving an environment through an engine), never for one of our services."""

from __future__ import annotations

import asyncio

from gyre.v1 import events_pb2
from services.rollout.agent import ExecutionOutcome, ExecutionSpec, Progress


class InstantAgent:
    """Scripted agent: every execution finishes at once with reward 1."""

    async def run(self, spec: ExecutionSpec, env: object) -> ExecutionOutcome:
        await asyncio.sleep(0)
        return ExecutionOutcome(
            kind=events_pb2.ExecutionEvent.KIND_FINISHED, num_calls=1, progress=Progress(), reward=1.0
        )


async def settle() -> None:
    """Let every task the manager started run until it waits (50 loop turns)."""
    for _ in range(50):
        await asyncio.sleep(0)
