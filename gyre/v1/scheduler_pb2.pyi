from gyre.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "service", "devices", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    service: str
    devices: _containers.RepeatedCompositeFieldContainer[_common_pb2.Device]
    address: str
    def __init__(self, worker_id: _Optional[str] = ..., service: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[_common_pb2.Device, _Mapping]]] = ..., address: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("leases", "heartbeat_interval_s")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[_common_pb2.Lease]
    heartbeat_interval_s: float
    def __init__(self, leases: _Optional[_Iterable[_Union[_common_pb2.Lease, _Mapping]]] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[_common_pb2.Lease]
    def __init__(self, leases: _Optional[_Iterable[_Union[_common_pb2.Lease, _Mapping]]] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("live_executions", "queued_generations", "running_generations", "waiting_on_environment", "trainer_backlog_batches", "trainer_step_s", "weight_version", "engine_capacity", "trainer_backlog_groups", "trainer_step_in_progress", "trainer_remaining_work_device_s", "trainer_dp_size", "engines", "busy_device_s")
    LIVE_EXECUTIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    WAITING_ON_ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    TRAINER_BACKLOG_BATCHES_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    TRAINER_BACKLOG_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_REMAINING_WORK_DEVICE_S_FIELD_NUMBER: _ClassVar[int]
    TRAINER_DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    BUSY_DEVICE_S_FIELD_NUMBER: _ClassVar[int]
    live_executions: int
    queued_generations: int
    running_generations: int
    waiting_on_environment: int
    trainer_backlog_batches: int
    trainer_step_s: float
    weight_version: int
    engine_capacity: int
    trainer_backlog_groups: int
    trainer_step_in_progress: bool
    trainer_remaining_work_device_s: float
    trainer_dp_size: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineLoad]
    busy_device_s: float
    def __init__(self, live_executions: _Optional[int] = ..., queued_generations: _Optional[int] = ..., running_generations: _Optional[int] = ..., waiting_on_environment: _Optional[int] = ..., trainer_backlog_batches: _Optional[int] = ..., trainer_step_s: _Optional[float] = ..., weight_version: _Optional[int] = ..., engine_capacity: _Optional[int] = ..., trainer_backlog_groups: _Optional[int] = ..., trainer_step_in_progress: _Optional[bool] = ..., trainer_remaining_work_device_s: _Optional[float] = ..., trainer_dp_size: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineLoad, _Mapping]]] = ..., busy_device_s: _Optional[float] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("device_id", "executions", "generating", "context_tokens")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTIONS_FIELD_NUMBER: _ClassVar[int]
    GENERATING_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    executions: int
    generating: int
    context_tokens: int
    def __init__(self, device_id: _Optional[str] = ..., executions: _Optional[int] = ..., generating: _Optional[int] = ..., context_tokens: _Optional[int] = ...) -> None: ...

class ReportLoadRequest(_message.Message):
    __slots__ = ("worker_id", "load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: WorkerLoad
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ...) -> None: ...

class ReportLoadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("worker_id", "device_id", "epoch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    device_id: str
    epoch: int
    def __init__(self, worker_id: _Optional[str] = ..., device_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("worker_id", "device_id", "epoch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    device_id: str
    epoch: int
    def __init__(self, worker_id: _Optional[str] = ..., device_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: _common_pb2.Lease
    def __init__(self, lease: _Optional[_Union[_common_pb2.Lease, _Mapping]] = ...) -> None: ...

class GetPoolRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPoolResponse(_message.Message):
    __slots__ = ("leases", "devices", "policy")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[_common_pb2.Lease]
    devices: _containers.RepeatedCompositeFieldContainer[_common_pb2.Device]
    policy: str
    def __init__(self, leases: _Optional[_Iterable[_Union[_common_pb2.Lease, _Mapping]]] = ..., devices: _Optional[_Iterable[_Union[_common_pb2.Device, _Mapping]]] = ..., policy: _Optional[str] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    def __init__(self, policy: _Optional[str] = ...) -> None: ...

class SetPolicyResponse(_message.Message):
    __slots__ = ("previous_policy",)
    PREVIOUS_POLICY_FIELD_NUMBER: _ClassVar[int]
    previous_policy: str
    def __init__(self, previous_policy: _Optional[str] = ...) -> None: ...
