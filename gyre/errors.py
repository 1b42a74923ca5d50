"""Domain errors shared by every service.

Services raise these inside; each service maps them to a gRPC status (gyre.rpc) or a NATS
nak/term decision at its one boundary. Messages say what was wrong and how to fix it.
"""

from __future__ import annotations


class GyreError(Exception):
    """Base of every error Gyre raises on purpose."""


class InvalidArgument(GyreError):
    """Malformed or out-of-range input (NaN reward, empty prompt, oversized message). gRPC INVALID_ARGUMENT."""


class NotFound(GyreError):
    """An unknown ID (device, worker, execution, batch). gRPC NOT_FOUND."""


class StaleEpoch(GyreError):
    """An action carried a lease epoch older than the current one (fencing). gRPC FAILED_PRECONDITION."""

    def __init__(self, device_id: str, given: int, current: int) -> None:
        super().__init__(
            f"stale epoch for device {device_id!r}: request carried epoch {given}, current epoch is "
            f"{current}; re-read the lease (GetPool/Heartbeat) and act on the current epoch"
        )
        self.device_id = device_id
        self.given = given
        self.current = current


class Conflict(GyreError):
    """The action is not allowed in the current state (e.g. acquire a device not granted). gRPC FAILED_PRECONDITION."""


class PermissionDenied(GyreError):
    """The caller is authenticated but may not do this (e.g. PullBatch by a consumer that is not the
    registered trainer). gRPC PERMISSION_DENIED."""


class PayloadTooLarge(GyreError):
    """A message exceeds the transport's limit (NATS max_payload, gRPC max message). gRPC RESOURCE_EXHAUSTED."""


class Unavailable(GyreError):
    """A dependency (NATS, Postgres, an engine) cannot be reached right now; retry later. gRPC UNAVAILABLE."""


class ConfigError(GyreError):
    """A configuration value is wrong; the message names the field and how to fix it."""
