"""Conversions between the scheduler's lease objects and the gyre.v1 protobuf contract."""

from __future__ import annotations

from gyre.v1 import common_pb2, events_pb2
from services.scheduler.leases import ChangeKind, DeviceInfo, Lease, LeaseChange, LeaseState
from services.scheduler.policies import Role

ROLE_TO_PB = {
    Role.IDLE: common_pb2.DEVICE_ROLE_IDLE,
    Role.ROLLOUT: common_pb2.DEVICE_ROLE_ROLLOUT,
    Role.TRAIN: common_pb2.DEVICE_ROLE_TRAIN,
}
PB_TO_ROLE = {pb: role for role, pb in ROLE_TO_PB.items()}
STATE_TO_PB = {
    LeaseState.ACTIVE: common_pb2.LEASE_STATE_ACTIVE,
    LeaseState.DRAINING: common_pb2.LEASE_STATE_DRAINING,
    LeaseState.RELEASED: common_pb2.LEASE_STATE_RELEASED,
    LeaseState.GRANTED: common_pb2.LEASE_STATE_GRANTED,
}
KIND_TO_PB = {
    ChangeKind.REASSIGN: events_pb2.LeaseEvent.KIND_REASSIGN,
    ChangeKind.RELEASED: events_pb2.LeaseEvent.KIND_RELEASED,
    ChangeKind.GRANTED: events_pb2.LeaseEvent.KIND_GRANTED,
    ChangeKind.ACQUIRED: events_pb2.LeaseEvent.KIND_ACQUIRED,
    ChangeKind.ROLLED_BACK: events_pb2.LeaseEvent.KIND_ROLLED_BACK,
    ChangeKind.REGISTERED: events_pb2.LeaseEvent.KIND_REGISTERED,
}


def lease_pb(lease: Lease) -> common_pb2.Lease:
    return common_pb2.Lease(
        device_id=lease.device_id,
        role=ROLE_TO_PB[lease.role],
        holder=lease.holder,
        epoch=lease.epoch,
        state=STATE_TO_PB[lease.state],
        target_role=ROLE_TO_PB[lease.target_role]
        if lease.target_role
        else common_pb2.DEVICE_ROLE_UNSPECIFIED,
        target_holder=lease.target_holder,
        deadline_unix_s=lease.deadline_unix_s,
        updated_unix_s=lease.updated_unix_s,
    )


def device_pb(d: DeviceInfo) -> common_pb2.Device:
    return common_pb2.Device(device_id=d.device_id, node=d.node, index=d.index, kind=d.kind)


def device_from_pb(d: common_pb2.Device) -> DeviceInfo:
    return DeviceInfo(d.device_id, d.node, d.index, d.kind)


def lease_event(run_id: str, change: LeaseChange) -> events_pb2.LeaseEvent:
    return events_pb2.LeaseEvent(
        event_id=change.event_id,
        run_id=run_id,
        kind=KIND_TO_PB[change.kind],
        lease=lease_pb(change.lease),
        from_role=ROLE_TO_PB[change.from_role] if change.from_role else common_pb2.DEVICE_ROLE_UNSPECIFIED,
        policy=change.policy,
        reason=change.reason,
        created_unix_s=change.created_unix_s,
    )
