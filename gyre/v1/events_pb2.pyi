from gyre.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LeaseEvent(_message.Message):
    __slots__ = ("event_id", "run_id", "kind", "lease", "from_role", "policy", "reason", "created_unix_s")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[LeaseEvent.Kind]
        KIND_REASSIGN: _ClassVar[LeaseEvent.Kind]
        KIND_RELEASED: _ClassVar[LeaseEvent.Kind]
        KIND_GRANTED: _ClassVar[LeaseEvent.Kind]
        KIND_ACQUIRED: _ClassVar[LeaseEvent.Kind]
        KIND_ROLLED_BACK: _ClassVar[LeaseEvent.Kind]
        KIND_REGISTERED: _ClassVar[LeaseEvent.Kind]
    KIND_UNSPECIFIED: LeaseEvent.Kind
    KIND_REASSIGN: LeaseEvent.Kind
    KIND_RELEASED: LeaseEvent.Kind
    KIND_GRANTED: LeaseEvent.Kind
    KIND_ACQUIRED: LeaseEvent.Kind
    KIND_ROLLED_BACK: LeaseEvent.Kind
    KIND_REGISTERED: LeaseEvent.Kind
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    run_id: str
    kind: LeaseEvent.Kind
    lease: _common_pb2.Lease
    from_role: _common_pb2.DeviceRole
    policy: str
    reason: str
    created_unix_s: float
    def __init__(self, event_id: _Optional[str] = ..., run_id: _Optional[str] = ..., kind: _Optional[_Union[LeaseEvent.Kind, str]] = ..., lease: _Optional[_Union[_common_pb2.Lease, _Mapping]] = ..., from_role: _Optional[_Union[_common_pb2.DeviceRole, str]] = ..., policy: _Optional[str] = ..., reason: _Optional[str] = ..., created_unix_s: _Optional[float] = ...) -> None: ...

class ExecutionEvent(_message.Message):
    __slots__ = ("event_id", "run_id", "task_id", "group_id", "execution_id", "kind", "reward", "progress", "num_calls", "environment", "error", "created_unix_s")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[ExecutionEvent.Kind]
        KIND_STARTED: _ClassVar[ExecutionEvent.Kind]
        KIND_FINISHED: _ClassVar[ExecutionEvent.Kind]
        KIND_TRUNCATED: _ClassVar[ExecutionEvent.Kind]
        KIND_FAILED: _ClassVar[ExecutionEvent.Kind]
        KIND_RESUMED: _ClassVar[ExecutionEvent.Kind]
    KIND_UNSPECIFIED: ExecutionEvent.Kind
    KIND_STARTED: ExecutionEvent.Kind
    KIND_FINISHED: ExecutionEvent.Kind
    KIND_TRUNCATED: ExecutionEvent.Kind
    KIND_FAILED: ExecutionEvent.Kind
    KIND_RESUMED: ExecutionEvent.Kind
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_CALLS_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    run_id: str
    task_id: str
    group_id: str
    execution_id: str
    kind: ExecutionEvent.Kind
    reward: float
    progress: _common_pb2.ProgressSignal
    num_calls: int
    environment: str
    error: str
    created_unix_s: float
    def __init__(self, event_id: _Optional[str] = ..., run_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., execution_id: _Optional[str] = ..., kind: _Optional[_Union[ExecutionEvent.Kind, str]] = ..., reward: _Optional[float] = ..., progress: _Optional[_Union[_common_pb2.ProgressSignal, _Mapping]] = ..., num_calls: _Optional[int] = ..., environment: _Optional[str] = ..., error: _Optional[str] = ..., created_unix_s: _Optional[float] = ...) -> None: ...

class StepEvent(_message.Message):
    __slots__ = ("event_id", "run_id", "task_id", "group_id", "execution_id", "call_seq", "prompt_token_ids", "completion_token_ids", "completion_logprobs", "completion_versions", "progress", "agent_id", "num_migrations", "engine_ids", "context_event", "started_unix_s", "finished_unix_s", "prompt_base_call_seq", "prompt_base_len", "prompt_num_tokens", "prompt_crc32", "part_index", "num_parts")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_SEQ_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_EVENT_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BASE_CALL_SEQ_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CRC32_FIELD_NUMBER: _ClassVar[int]
    PART_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTS_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    run_id: str
    task_id: str
    group_id: str
    execution_id: str
    call_seq: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_logprobs: _containers.RepeatedScalarFieldContainer[float]
    completion_versions: _containers.RepeatedScalarFieldContainer[int]
    progress: _common_pb2.ProgressSignal
    agent_id: str
    num_migrations: int
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    context_event: str
    started_unix_s: float
    finished_unix_s: float
    prompt_base_call_seq: int
    prompt_base_len: int
    prompt_num_tokens: int
    prompt_crc32: int
    part_index: int
    num_parts: int
    def __init__(self, event_id: _Optional[str] = ..., run_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., execution_id: _Optional[str] = ..., call_seq: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., completion_logprobs: _Optional[_Iterable[float]] = ..., completion_versions: _Optional[_Iterable[int]] = ..., progress: _Optional[_Union[_common_pb2.ProgressSignal, _Mapping]] = ..., agent_id: _Optional[str] = ..., num_migrations: _Optional[int] = ..., engine_ids: _Optional[_Iterable[str]] = ..., context_event: _Optional[str] = ..., started_unix_s: _Optional[float] = ..., finished_unix_s: _Optional[float] = ..., prompt_base_call_seq: _Optional[int] = ..., prompt_base_len: _Optional[int] = ..., prompt_num_tokens: _Optional[int] = ..., prompt_crc32: _Optional[int] = ..., part_index: _Optional[int] = ..., num_parts: _Optional[int] = ...) -> None: ...

class BatchReadyEvent(_message.Message):
    __slots__ = ("event_id", "run_id", "batch_id", "num_trees", "num_paths", "num_tokens", "num_flat_tokens", "min_policy_version", "max_policy_version", "num_partial_paths", "created_unix_s")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TREES_FIELD_NUMBER: _ClassVar[int]
    NUM_PATHS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FLAT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTIAL_PATHS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    run_id: str
    batch_id: str
    num_trees: int
    num_paths: int
    num_tokens: int
    num_flat_tokens: int
    min_policy_version: int
    max_policy_version: int
    num_partial_paths: int
    created_unix_s: float
    def __init__(self, event_id: _Optional[str] = ..., run_id: _Optional[str] = ..., batch_id: _Optional[str] = ..., num_trees: _Optional[int] = ..., num_paths: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_flat_tokens: _Optional[int] = ..., min_policy_version: _Optional[int] = ..., max_policy_version: _Optional[int] = ..., num_partial_paths: _Optional[int] = ..., created_unix_s: _Optional[float] = ...) -> None: ...

class GroupScoredEvent(_message.Message):
    __slots__ = ("event_id", "run_id", "task_id", "group_id", "num_paths", "num_exact_merged", "num_near_duplicates", "reward_mean", "reward_std", "num_partial", "created_unix_s", "advantage_abs_max")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PATHS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXACT_MERGED_FIELD_NUMBER: _ClassVar[int]
    NUM_NEAR_DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    REWARD_STD_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_ABS_MAX_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    run_id: str
    task_id: str
    group_id: str
    num_paths: int
    num_exact_merged: int
    num_near_duplicates: int
    reward_mean: float
    reward_std: float
    num_partial: int
    created_unix_s: float
    advantage_abs_max: float
    def __init__(self, event_id: _Optional[str] = ..., run_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., num_paths: _Optional[int] = ..., num_exact_merged: _Optional[int] = ..., num_near_duplicates: _Optional[int] = ..., reward_mean: _Optional[float] = ..., reward_std: _Optional[float] = ..., num_partial: _Optional[int] = ..., created_unix_s: _Optional[float] = ..., advantage_abs_max: _Optional[float] = ...) -> None: ...

class GroupDroppedEvent(_message.Message):
    __slots__ = ("event_id", "run_id", "task_id", "group_id", "reason", "created_unix_s")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    run_id: str
    task_id: str
    group_id: str
    reason: str
    created_unix_s: float
    def __init__(self, event_id: _Optional[str] = ..., run_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., reason: _Optional[str] = ..., created_unix_s: _Optional[float] = ...) -> None: ...

class WeightsPublishedEvent(_message.Message):
    __slots__ = ("event_id", "run_id", "weights", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    run_id: str
    weights: _common_pb2.WeightVersion
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, event_id: _Optional[str] = ..., run_id: _Optional[str] = ..., weights: _Optional[_Union[_common_pb2.WeightVersion, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class MetricsEvent(_message.Message):
    __slots__ = ("event_id", "run_id", "service", "values", "created_unix_s")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    run_id: str
    service: str
    values: _containers.ScalarMap[str, float]
    created_unix_s: float
    def __init__(self, event_id: _Optional[str] = ..., run_id: _Optional[str] = ..., service: _Optional[str] = ..., values: _Optional[_Mapping[str, float]] = ..., created_unix_s: _Optional[float] = ...) -> None: ...
