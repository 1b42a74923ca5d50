"""Configuration of the trajectory service (the ``trajectory:`` section of a run's YAML)."""

from __future__ import annotations

from pydantic import Field, model_validator

from gyre.config import ConfigModel
from gyre.tokenizers import TOKENIZER_FIELD_DESCRIPTION, vocabulary_problem
from services.trajectory.scoring import CreditAssignment


class TrajectoryConfig(ConfigModel):
    """Ingest, readiness, scoring, dedup and batching of the trajectory service."""

    max_batch_tokens: int = Field(
        65_536,
        ge=1,
        description="Token budget of a packed batch (tree tokens, each counted once) when PullBatch gives none.",
    )
    max_chunk_bytes: int = Field(
        4 * 1024 * 1024,
        ge=4096,
        le=32 * 1024 * 1024,
        description=(
            "Largest BatchChunk message of PullBatch (serialized bytes): a tree larger than this is streamed "
            "in several chunks, and packing holds one chunk's arrays at a time."
        ),
    )
    min_batch_fill: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="A batch is built and announced (BatchReadyEvent) once scored groups hold this fraction of max_batch_tokens.",
    )
    batch_max_wait_s: float = Field(
        5.0,
        ge=0.0,
        description="Seconds a scored group waits before a batch is built even below min_batch_fill.",
    )
    max_staleness: int = Field(
        4,
        ge=0,
        description="Versions: groups whose oldest trained token is older than current_version - max_staleness are dropped (counted).",
    )
    group_size: int = Field(
        0,
        ge=0,
        description="Executions a group must have before it can be scored; 0 = as many as have been seen when all ended.",
    )
    train_unfinished_after_s: float | None = Field(
        None,
        ge=0.0,
        description=(
            "Seconds after the first execution of a group ended after which executions still running are scored as "
            "partial from their last progress signal; unset = wait for every execution to end."
        ),
    )
    scorer: str = Field(
        "progress", description="'progress' (built-in) or 'package.module:Class' of a custom scorer."
    )
    reward_min: float = Field(0.0, description="Lowest valid reward; a smaller (or NaN) reward is rejected.")
    reward_max: float = Field(
        1.0, description="Highest valid reward; a larger (or infinite) reward is rejected."
    )
    partial_scale: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Factor on the progress fraction of partial scores (1 = full credit for progress).",
    )
    normalise_advantage_std: bool = Field(
        True, description="Divide group advantages by the group's reward std (GRPO)."
    )
    credit_assignment: CreditAssignment = Field(
        "execution",
        description=(
            "How rewards become per-token advantages (docs/trainer.md, 'Credit assignment'): 'execution' = one GRPO "
            "advantage per execution on all its tokens; 'progress' = each call credited with the progress the "
            "environment reported after it, minus the group's mean progress per call; 'tree' = per-call values "
            "from the task tree (mean reward of the executions through a node)."
        ),
    )
    progress_discount: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description=(
            "credit_assignment 'progress': weight of later calls' progress in a call's advantage (0 = only its own "
            "progress, 1 = all progress after it)."
        ),
    )
    tree_local_coef: float = Field(
        1.0,
        ge=0.0,
        description="credit_assignment 'tree': weight of V(node after the call) - V(node of its prompt).",
    )
    tree_global_coef: float = Field(
        0.0,
        ge=0.0,
        description="credit_assignment 'tree': weight of V(node after the call) - group mean reward.",
    )
    near_duplicate_threshold: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Estimated Jaccard similarity of action shingles at or above which executions are near duplicates; 1 = off.",
    )
    near_duplicate_num_perm: int = Field(
        128, ge=16, description="MinHash permutations (more = more exact, slower)."
    )
    shingle_size: int = Field(4, ge=1, description="Tokens per action shingle for near-duplicate detection.")
    ingest_batch_size: int = Field(
        512, ge=1, description="Steps fetched from JetStream and committed to Postgres at once (at most)."
    )
    ingest_fetch_max_bytes: int = Field(
        16 << 20,
        ge=1 << 20,
        description=(
            "Bytes of one JetStream fetch of steps (besides ingest_batch_size; at least the server's "
            "max_payload is used): keeps a backlog of large steps under the NATS server's pending limit "
            "of this connection (no slow-consumer disconnects) and bounds the memory of a batch."
        ),
    )
    durable_name: str = Field(
        "trajectory",
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Prefix of the durable JetStream consumer names.",
    )
    tokenizer: str = Field("byte", description=TOKENIZER_FIELD_DESCRIPTION)
    vocab_size: int | None = Field(
        None,
        ge=1,
        description=(
            "Token ids of a step must lie in [0, vocab_size); others are dead-lettered. Unset: not checked "
            "(`gyre up` sets it from the run's trainer.model.vocab_size)."
        ),
    )
    max_version_lead: int = Field(
        2,
        ge=0,
        description=(
            "Versions: a step whose newest token version is ahead of the newest WeightsPublishedEvent seen by at "
            "most this is retried later (its weights event is on its way); further ahead, it is dead-lettered."
        ),
    )
    trainer_workers: list[str] = Field(
        default_factory=lambda: ["trainer-0"],
        min_length=1,
        description=(
            "Worker IDs (the trainer's worker_id) allowed to PullBatch and AckBatch; any other consumer gets "
            "PERMISSION_DENIED, and a batch is resumed or acked only by the consumer it was handed to."
        ),
    )
    ready_poll_s: float = Field(
        0.5, gt=0.0, description="Seconds between checks for ready groups and batches to build."
    )

    @model_validator(mode="after")
    def _check_range(self) -> TrajectoryConfig:
        if not self.reward_min < self.reward_max:
            raise ValueError(
                f"reward_min ({self.reward_min}) must be smaller than reward_max ({self.reward_max})"
            )
        if self.vocab_size is not None:
            problem = vocabulary_problem(self.tokenizer, self.vocab_size, "trajectory.vocab_size")
            if problem:
                raise ValueError(problem)
        return self
