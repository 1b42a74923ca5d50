from gyre.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "max_tokens", "seed", "stop_token_ids", "top_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    max_tokens: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_p: float
    def __init__(self, temperature: _Optional[float] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., top_p: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "execution_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    execution_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., execution_id: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "versions", "finish_reason", "num_migrations", "engine_ids")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    num_migrations: int
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., num_migrations: _Optional[int] = ..., engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StartExecutionsRequest(_message.Message):
    __slots__ = ("num_tasks", "group_size")
    NUM_TASKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_tasks: int
    group_size: int
    def __init__(self, num_tasks: _Optional[int] = ..., group_size: _Optional[int] = ...) -> None: ...

class StartExecutionsResponse(_message.Message):
    __slots__ = ("execution_ids",)
    EXECUTION_IDS_FIELD_NUMBER: _ClassVar[int]
    execution_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, execution_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("engine_id", "device_id", "state", "weight_version", "running", "tokens_generated")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    device_id: str
    state: str
    weight_version: int
    running: int
    tokens_generated: int
    def __init__(self, engine_id: _Optional[str] = ..., device_id: _Optional[str] = ..., state: _Optional[str] = ..., weight_version: _Optional[int] = ..., running: _Optional[int] = ..., tokens_generated: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("engines", "live_executions", "executions_started", "executions_completed", "executions_interrupted", "migrations", "state", "executions_resumed", "engine_restarts")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    LIVE_EXECUTIONS_FIELD_NUMBER: _ClassVar[int]
    EXECUTIONS_STARTED_FIELD_NUMBER: _ClassVar[int]
    EXECUTIONS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    EXECUTIONS_INTERRUPTED_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXECUTIONS_RESUMED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    live_executions: int
    executions_started: int
    executions_completed: int
    executions_interrupted: int
    migrations: int
    state: _common_pb2.ServiceState
    executions_resumed: int
    engine_restarts: int
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., live_executions: _Optional[int] = ..., executions_started: _Optional[int] = ..., executions_completed: _Optional[int] = ..., executions_interrupted: _Optional[int] = ..., migrations: _Optional[int] = ..., state: _Optional[_Union[_common_pb2.ServiceState, str]] = ..., executions_resumed: _Optional[int] = ..., engine_restarts: _Optional[int] = ...) -> None: ...
