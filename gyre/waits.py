"""What a service is waiting on, served to the job's watchdog (proto/gyre/v1/waits.proto).

A service says what its loops wait for by overriding `Service.waits()` (gyre/service.py), computed
from its own state when asked: nothing is recorded on the hot path. `WaitsServicer` answers
`Waits.GetWaits` on every service's gRPC server; `ask_waits` is the client the watchdog uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from gyre import rpc
from gyre.v1 import waits_pb2, waits_pb2_grpc


def wait(loop: str, waiting_for: str, since_unix_s: float = 0.0) -> waits_pb2.Wait:
    """One wait of one loop (`since_unix_s` 0: not tracked)."""
    return waits_pb2.Wait(loop=loop, waiting_for=waiting_for, since_unix_s=since_unix_s)


class WaitsServicer(waits_pb2_grpc.WaitsServicer):
    """Answers GetWaits from `current()`, the service's waits at the time of the call."""

    def __init__(self, service: str, current: Callable[[], list[waits_pb2.Wait]]) -> None:
        self.service = service
        self.current = current

    async def GetWaits(  # noqa: N802 (gRPC method name)
        self, request: waits_pb2.GetWaitsRequest, context: grpc.aio.ServicerContext
    ) -> waits_pb2.GetWaitsResponse:
        return waits_pb2.GetWaitsResponse(service=self.service, waits=self.current())


async def ask_waits(address: str, timeout_s: float = 5.0) -> waits_pb2.GetWaitsResponse:
    """The waits of the service at `address` (gRPC errors propagate: a dead service cannot say)."""
    async with rpc.channel(address) as channel:
        stub = waits_pb2_grpc.WaitsStub(channel)
        reply: waits_pb2.GetWaitsResponse = await stub.GetWaits(
            waits_pb2.GetWaitsRequest(), timeout=timeout_s
        )
        return reply


def age_s(w: waits_pb2.Wait, now: float | None = None) -> float | None:
    """Seconds the wait has lasted (None when its start is not tracked)."""
    if w.since_unix_s <= 0:
        return None
    return max(0.0, (now or time.time()) - w.since_unix_s)
