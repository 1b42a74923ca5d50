from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetWaitsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWaitsResponse(_message.Message):
    __slots__ = ("service", "waits")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    WAITS_FIELD_NUMBER: _ClassVar[int]
    service: str
    waits: _containers.RepeatedCompositeFieldContainer[Wait]
    def __init__(self, service: _Optional[str] = ..., waits: _Optional[_Iterable[_Union[Wait, _Mapping]]] = ...) -> None: ...

class Wait(_message.Message):
    __slots__ = ("loop", "waiting_for", "since_unix_s")
    LOOP_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    loop: str
    waiting_for: str
    since_unix_s: float
    def __init__(self, loop: _Optional[str] = ..., waiting_for: _Optional[str] = ..., since_unix_s: _Optional[float] = ...) -> None: ...
