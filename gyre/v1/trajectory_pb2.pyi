from gyre.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class IngestSummary(_message.Message):
    __slots__ = ("num_received", "num_stored", "num_duplicates", "num_rejected", "errors", "num_waiting")
    NUM_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    num_received: int
    num_stored: int
    num_duplicates: int
    num_rejected: int
    errors: _containers.RepeatedScalarFieldContainer[str]
    num_waiting: int
    def __init__(self, num_received: _Optional[int] = ..., num_stored: _Optional[int] = ..., num_duplicates: _Optional[int] = ..., num_rejected: _Optional[int] = ..., errors: _Optional[_Iterable[str]] = ..., num_waiting: _Optional[int] = ...) -> None: ...

class PullBatchRequest(_message.Message):
    __slots__ = ("run_id", "max_tokens", "wait_s", "resume_batch_id", "consumer", "current_version", "stream_part", "step_tokens", "confirm_receipt")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    RESUME_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STREAM_PART_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_RECEIPT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    max_tokens: int
    wait_s: float
    resume_batch_id: str
    consumer: str
    current_version: int
    stream_part: bool
    step_tokens: int
    confirm_receipt: bool
    def __init__(self, run_id: _Optional[str] = ..., max_tokens: _Optional[int] = ..., wait_s: _Optional[float] = ..., resume_batch_id: _Optional[str] = ..., consumer: _Optional[str] = ..., current_version: _Optional[int] = ..., stream_part: _Optional[bool] = ..., step_tokens: _Optional[int] = ..., confirm_receipt: _Optional[bool] = ...) -> None: ...

class BatchChunk(_message.Message):
    __slots__ = ("batch_id", "chunk_index", "last", "token_ids", "position_ids", "node_offsets", "node_lengths", "node_parents", "loss_mask", "weight_pos", "weight_neg", "kl_weight", "behaviour_logprobs", "policy_versions", "num_paths", "num_flat_tokens", "group_ids", "reward_sum", "num_partial_paths", "normaliser", "tree_index", "first_node", "first_token", "tree_continues")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITION_IDS_FIELD_NUMBER: _ClassVar[int]
    NODE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NODE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    NODE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_POS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_NEG_FIELD_NUMBER: _ClassVar[int]
    KL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PATHS_FIELD_NUMBER: _ClassVar[int]
    NUM_FLAT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_SUM_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTIAL_PATHS_FIELD_NUMBER: _ClassVar[int]
    NORMALISER_FIELD_NUMBER: _ClassVar[int]
    TREE_INDEX_FIELD_NUMBER: _ClassVar[int]
    FIRST_NODE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TREE_CONTINUES_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    chunk_index: int
    last: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    position_ids: _containers.RepeatedScalarFieldContainer[int]
    node_offsets: _containers.RepeatedScalarFieldContainer[int]
    node_lengths: _containers.RepeatedScalarFieldContainer[int]
    node_parents: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    weight_pos: _containers.RepeatedScalarFieldContainer[float]
    weight_neg: _containers.RepeatedScalarFieldContainer[float]
    kl_weight: _containers.RepeatedScalarFieldContainer[float]
    behaviour_logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    num_paths: int
    num_flat_tokens: int
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    reward_sum: float
    num_partial_paths: int
    normaliser: float
    tree_index: int
    first_node: int
    first_token: int
    tree_continues: bool
    def __init__(self, batch_id: _Optional[str] = ..., chunk_index: _Optional[int] = ..., last: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ..., position_ids: _Optional[_Iterable[int]] = ..., node_offsets: _Optional[_Iterable[int]] = ..., node_lengths: _Optional[_Iterable[int]] = ..., node_parents: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., weight_pos: _Optional[_Iterable[float]] = ..., weight_neg: _Optional[_Iterable[float]] = ..., kl_weight: _Optional[_Iterable[float]] = ..., behaviour_logprobs: _Optional[_Iterable[float]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., num_paths: _Optional[int] = ..., num_flat_tokens: _Optional[int] = ..., group_ids: _Optional[_Iterable[str]] = ..., reward_sum: _Optional[float] = ..., num_partial_paths: _Optional[int] = ..., normaliser: _Optional[float] = ..., tree_index: _Optional[int] = ..., first_node: _Optional[int] = ..., first_token: _Optional[int] = ..., tree_continues: _Optional[bool] = ...) -> None: ...

class AckBatchRequest(_message.Message):
    __slots__ = ("batch_id", "consumer", "trained_at_version", "received")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    TRAINED_AT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    consumer: str
    trained_at_version: int
    received: bool
    def __init__(self, batch_id: _Optional[str] = ..., consumer: _Optional[str] = ..., trained_at_version: _Optional[int] = ..., received: _Optional[bool] = ...) -> None: ...

class AckBatchResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExportExecutionRequest(_message.Message):
    __slots__ = ("execution_id",)
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    def __init__(self, execution_id: _Optional[str] = ...) -> None: ...

class ExportedCall(_message.Message):
    __slots__ = ("call_seq", "prompt_token_ids", "completion_token_ids", "completion_logprobs", "completion_versions", "agent_id")
    CALL_SEQ_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    call_seq: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_logprobs: _containers.RepeatedScalarFieldContainer[float]
    completion_versions: _containers.RepeatedScalarFieldContainer[int]
    agent_id: str
    def __init__(self, call_seq: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., completion_logprobs: _Optional[_Iterable[float]] = ..., completion_versions: _Optional[_Iterable[int]] = ..., agent_id: _Optional[str] = ...) -> None: ...

class ExportExecutionResponse(_message.Message):
    __slots__ = ("execution_id", "task_id", "group_id", "calls")
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    task_id: str
    group_id: str
    calls: _containers.RepeatedCompositeFieldContainer[ExportedCall]
    def __init__(self, execution_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., calls: _Optional[_Iterable[_Union[ExportedCall, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("values", "stats")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    stats: TrajectoryStats
    def __init__(self, values: _Optional[_Mapping[str, float]] = ..., stats: _Optional[_Union[TrajectoryStats, _Mapping]] = ...) -> None: ...

class TrajectoryStats(_message.Message):
    __slots__ = ("tree_tokens", "tree_nodes", "executions", "groups_open", "groups_scored", "groups_batched", "groups_dropped_stale", "groups_rejected", "groups_empty", "stored_calls", "stored_nodes", "rejections", "dedup_records", "batches_ready", "batches_delivered", "batches_acked", "latest_weights_version", "batches_quarantined")
    TREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    EXECUTIONS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_OPEN_FIELD_NUMBER: _ClassVar[int]
    GROUPS_SCORED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_BATCHED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_EMPTY_FIELD_NUMBER: _ClassVar[int]
    STORED_CALLS_FIELD_NUMBER: _ClassVar[int]
    STORED_NODES_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    DEDUP_RECORDS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_READY_FIELD_NUMBER: _ClassVar[int]
    BATCHES_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_ACKED_FIELD_NUMBER: _ClassVar[int]
    LATEST_WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCHES_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    tree_tokens: int
    tree_nodes: int
    executions: int
    groups_open: int
    groups_scored: int
    groups_batched: int
    groups_dropped_stale: int
    groups_rejected: int
    groups_empty: int
    stored_calls: int
    stored_nodes: int
    rejections: int
    dedup_records: int
    batches_ready: int
    batches_delivered: int
    batches_acked: int
    latest_weights_version: int
    batches_quarantined: int
    def __init__(self, tree_tokens: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., executions: _Optional[int] = ..., groups_open: _Optional[int] = ..., groups_scored: _Optional[int] = ..., groups_batched: _Optional[int] = ..., groups_dropped_stale: _Optional[int] = ..., groups_rejected: _Optional[int] = ..., groups_empty: _Optional[int] = ..., stored_calls: _Optional[int] = ..., stored_nodes: _Optional[int] = ..., rejections: _Optional[int] = ..., dedup_records: _Optional[int] = ..., batches_ready: _Optional[int] = ..., batches_delivered: _Optional[int] = ..., batches_acked: _Optional[int] = ..., latest_weights_version: _Optional[int] = ..., batches_quarantined: _Optional[int] = ...) -> None: ...
