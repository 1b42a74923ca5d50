from gyre.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerStatusResponse(_message.Message):
    __slots__ = ("step", "latest_weights", "dp_size", "device_ids", "last_metrics", "state")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    LATEST_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    step: int
    latest_weights: _common_pb2.WeightVersion
    dp_size: int
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    last_metrics: _containers.ScalarMap[str, float]
    state: _common_pb2.ServiceState
    def __init__(self, step: _Optional[int] = ..., latest_weights: _Optional[_Union[_common_pb2.WeightVersion, _Mapping]] = ..., dp_size: _Optional[int] = ..., device_ids: _Optional[_Iterable[str]] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., state: _Optional[_Union[_common_pb2.ServiceState, str]] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...
