"""The rollout's part of the lease protocol: an inference engine per leased device.

The protocol itself (register, heartbeat, REASSIGN/GRANTED, epochs, catch-up) is
`gyre.lease_client.LeaseClient`; this module is the `DeviceUser` it drives:

    start_using(d) -> start an engine on d and add it to the router
    stop_using(d)  -> the router drains d's engine: in-flight generations are cut at their current
                      token and resubmitted to another engine (or parked until one exists); returns
                      when the engine has stopped, so the Release that follows frees the device
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection


class EngineDevices:
    """Engines on the devices this rollout worker brings (its `device_ids`)."""

    def __init__(
        self,
        device_ids: Collection[str],
        engines: Collection[str],
        start_engine: Callable[[str], Awaitable[None]],
        stop_engine: Callable[[str], Awaitable[None]],
    ) -> None:
        """`engines` is the router's live view of device -> engine (membership is all we read)."""
        self.device_ids, self.engines = set(device_ids), engines
        self._start, self._stop = start_engine, stop_engine

    def knows(self, device_id: str) -> bool:
        return device_id in self.device_ids

    def using(self, device_id: str) -> bool:
        return device_id in self.engines

    async def start_using(self, device_id: str) -> None:
        await self._start(device_id)

    async def stop_using(self, device_id: str) -> None:
        await self._stop(device_id)
