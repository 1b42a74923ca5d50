from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeviceRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_ROLE_UNSPECIFIED: _ClassVar[DeviceRole]
    DEVICE_ROLE_IDLE: _ClassVar[DeviceRole]
    DEVICE_ROLE_ROLLOUT: _ClassVar[DeviceRole]
    DEVICE_ROLE_TRAIN: _ClassVar[DeviceRole]

class LeaseState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_STATE_UNSPECIFIED: _ClassVar[LeaseState]
    LEASE_STATE_ACTIVE: _ClassVar[LeaseState]
    LEASE_STATE_DRAINING: _ClassVar[LeaseState]
    LEASE_STATE_RELEASED: _ClassVar[LeaseState]
    LEASE_STATE_GRANTED: _ClassVar[LeaseState]

class ServiceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVICE_STATE_UNSPECIFIED: _ClassVar[ServiceState]
    SERVICE_STATE_STARTING: _ClassVar[ServiceState]
    SERVICE_STATE_SERVING: _ClassVar[ServiceState]
    SERVICE_STATE_DRAINING: _ClassVar[ServiceState]
    SERVICE_STATE_STOPPED: _ClassVar[ServiceState]
DEVICE_ROLE_UNSPECIFIED: DeviceRole
DEVICE_ROLE_IDLE: DeviceRole
DEVICE_ROLE_ROLLOUT: DeviceRole
DEVICE_ROLE_TRAIN: DeviceRole
LEASE_STATE_UNSPECIFIED: LeaseState
LEASE_STATE_ACTIVE: LeaseState
LEASE_STATE_DRAINING: LeaseState
LEASE_STATE_RELEASED: LeaseState
LEASE_STATE_GRANTED: LeaseState
SERVICE_STATE_UNSPECIFIED: ServiceState
SERVICE_STATE_STARTING: ServiceState
SERVICE_STATE_SERVING: ServiceState
SERVICE_STATE_DRAINING: ServiceState
SERVICE_STATE_STOPPED: ServiceState

class Device(_message.Message):
    __slots__ = ("device_id", "node", "index", "kind")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    node: str
    index: int
    kind: str
    def __init__(self, device_id: _Optional[str] = ..., node: _Optional[str] = ..., index: _Optional[int] = ..., kind: _Optional[str] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("device_id", "role", "holder", "epoch", "state", "target_role", "target_holder", "deadline_unix_s", "updated_unix_s")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TARGET_ROLE_FIELD_NUMBER: _ClassVar[int]
    TARGET_HOLDER_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    role: DeviceRole
    holder: str
    epoch: int
    state: LeaseState
    target_role: DeviceRole
    target_holder: str
    deadline_unix_s: float
    updated_unix_s: float
    def __init__(self, device_id: _Optional[str] = ..., role: _Optional[_Union[DeviceRole, str]] = ..., holder: _Optional[str] = ..., epoch: _Optional[int] = ..., state: _Optional[_Union[LeaseState, str]] = ..., target_role: _Optional[_Union[DeviceRole, str]] = ..., target_holder: _Optional[str] = ..., deadline_unix_s: _Optional[float] = ..., updated_unix_s: _Optional[float] = ...) -> None: ...

class ProgressSignal(_message.Message):
    __slots__ = ("milestones_reached", "milestones_total", "tests_passed_fraction", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MILESTONES_REACHED_FIELD_NUMBER: _ClassVar[int]
    MILESTONES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TESTS_PASSED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    milestones_reached: int
    milestones_total: int
    tests_passed_fraction: float
    extra: _containers.ScalarMap[str, float]
    def __init__(self, milestones_reached: _Optional[int] = ..., milestones_total: _Optional[int] = ..., tests_passed_fraction: _Optional[float] = ..., extra: _Optional[_Mapping[str, float]] = ...) -> None: ...

class WeightVersion(_message.Message):
    __slots__ = ("version", "uri", "sha256", "train_step", "created_unix_s", "num_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TRAIN_STEP_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    uri: str
    sha256: str
    train_step: int
    created_unix_s: float
    num_bytes: int
    def __init__(self, version: _Optional[int] = ..., uri: _Optional[str] = ..., sha256: _Optional[str] = ..., train_step: _Optional[int] = ..., created_unix_s: _Optional[float] = ..., num_bytes: _Optional[int] = ...) -> None: ...
