"""The trainer's configuration (the `trainer:` section of a run YAML)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gyre.config import ConfigModel
from gyre.model.config import ModelConfig, tensor_parallel_problem
from gyre.tokenizers import TOKENIZER_FIELD_DESCRIPTION, vocabulary_problem


class TrainerConfig(ConfigModel):
    """Optimisation, loss, data and lifecycle settings of the policy-gradient trainer."""

    worker_id: str = Field(
        default="trainer-0", pattern=r"^[A-Za-z0-9_-]+$", description="This trainer's worker ID."
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="Architecture of the trained model.")
    tokenizer: str = Field(default="byte", description=TOKENIZER_FIELD_DESCRIPTION)
    init_weights: str | None = Field(
        default=None,
        description="Weights to start from: an HF Llama/Qwen2 checkpoint directory (imported by gyre/model/hf.py; "
        "`model` must match it) or a Gyre safetensors file; None = random init.",
    )
    lr: float = Field(default=1e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, ge=0, description="Max global gradient norm; 0 = no clipping.")
    clip_eps: float = Field(
        default=0.2,
        gt=0,
        lt=1,
        description=(
            "PPO ratio clip, lower side: a token whose ratio fell below 1 - clip_eps (negative advantage) "
            "or rose above 1 + clip_eps_high (positive advantage) gets no gradient."
        ),
    )
    clip_eps_high: float | None = Field(
        default=0.28,
        gt=0,
        description=(
            "PPO ratio clip, upper side ('clip-higher', DAPO): a larger bound than clip_eps lets "
            "unlikely tokens with a positive advantage grow more per step; None = clip_eps (symmetric)."
        ),
    )
    entropy_coef: float = Field(
        default=0.1,
        ge=0,
        description=(
            "Weight of the entropy bonus (nats, full-vocabulary entropy at each trained token, "
            "token-mean weighted): keeps sampling diverse so groups keep reward variance; 0 = none."
        ),
    )
    entropy_target: float | None = Field(
        default=0.5,
        ge=0,
        description=(
            "Entropy floor (nats): the bonus counts min(entropy, entropy_target) per token, so it "
            "lifts only tokens whose entropy fell below it and never pushes a policy above it; None = no cap."
        ),
    )
    normalise_batch_advantages: bool = Field(
        default=False,
        description=(
            "Divide the policy-gradient term by the RMS of the step's token advantages (PPO's batch "
            "advantage normalisation, over the whole step before it is cut into micro-batches and "
            "data-parallel shards, so it does not depend on how many ranks train it): the step size no "
            "longer depends on the reward scale or on how far groups have converged, and entropy_coef "
            "is relative to unit advantages. The quickstart turns it on. Not with `streaming` (a "
            "streamed step does not know its whole batch when it starts)."
        ),
    )
    kl_coef: float = Field(
        default=0.0, ge=0, description="Weight of the KL to the initial (reference) model; 0 = none."
    )
    batch_max_tokens: int = Field(
        default=65_536,
        ge=1,
        description="Token budget of a batch packed at pull time (tree tokens, each counted once); the same "
        "default as trajectory.max_batch_tokens, which shapes the batches the trajectory service builds ahead. "
        "A ready batch is handed out whatever its size (never repacked for this budget); micro_batch_tokens "
        "bounds what trains at once.",
    )
    pull_wait_s: float = Field(
        default=2.0, ge=0, description="How long one PullBatch waits for enough scored groups (s)."
    )
    max_staleness: int = Field(
        default=4,
        ge=0,
        description="Tokens generated more than this many versions ago are not packed (trajectory drops them).",
    )
    keep_weight_versions: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Published weight versions kept in run_dir/weights (the newest ones; older files are "
            "deleted after each publish, services/trainer/weights_store.py): None = max_staleness + 2 "
            "(every version the staleness bound can still use, plus the one a rollout may be loading); "
            "0 = keep every version; otherwise at least max_staleness + 1."
        ),
    )
    checkpoint_every: int = Field(
        default=10, ge=1, description="Checkpoint every N optimizer steps (and on SaveCheckpoint)."
    )
    keep_checkpoints: int = Field(default=2, ge=1, description="Checkpoints kept on disk (oldest deleted).")
    max_steps: int = Field(
        default=0, ge=0, description="Stop after this many optimizer steps; 0 = run until stopped."
    )
    trajectory_address: str = Field(
        default="127.0.0.1:50052", description="gRPC host:port of the trajectory service."
    )
    scheduler_address: str | None = Field(
        default=None,
        description="Scheduler gRPC 'host:port': the trainer is a worker of the pool and trains only on "
        "the TRAIN devices it holds a lease for. Unset: standalone, one rank, no leases.",
    )
    report_load_interval_s: float = Field(
        default=1.0, gt=0, description="Seconds between two ReportLoad calls to the scheduler."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="Where a leased TRAIN device trains: `cpu` = every device is a logical slot of this "
        "CPU; `cuda` = the device's index on its node is cuda:N; `auto` = cuda when available, else cpu.",
    )
    micro_batch_tokens: int = Field(
        default=2048,
        ge=1,
        description="Token budget of a micro-batch: gradients accumulate over a step's micro-batches, and the "
        "data-parallel group grows or shrinks between two of them. A larger tree is split into parts of at most "
        "this many tokens with exact context (docs/trainer.md, 'Trees split across micro-batches').",
    )
    loss_chunk_tokens: int = Field(
        default=4096,
        ge=1,
        description="Tokens whose logits the loss holds at once: log-prob and entropy are computed this many "
        "tokens at a time (recomputed in backward), so the loss needs chunk x vocab floats, never "
        "tokens x vocab; the result equals the full computation (services/trainer/chunked_softmax.py).",
    )
    dtype: str = Field(
        default="float32", pattern=r"^(float32|bfloat16|float64)$", description="Parameter dtype."
    )
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="Compute precision. `fp32`: the model computes and is updated in `dtype` (plain AdamW). "
        "`bf16`: the model computes in bfloat16 while AdamW updates an fp32 master copy of every parameter; "
        "gradients accumulate and are all-reduced in fp32, and the bf16 weights are refreshed from the "
        "masters after each step (needs dtype float32: the masters' dtype). Published weights are the "
        "bf16 compute copy (services/trainer/sharded_optimizer.py).",
    )
    optimizer_sharding: Literal["none", "zero1"] = Field(
        default="none",
        description="`zero1`: each data-parallel rank keeps the AdamW moments (and fp32 masters) of its own "
        "1/DP of the parameters, steps them and broadcasts the updated parameters; re-sharded exactly when "
        "the group resizes. `none`: every rank holds the whole optimizer state.",
    )
    reference_precision: Literal["bf16", "same"] = Field(
        default="bf16",
        description="The KL reference model (built only when kl_coef > 0): `bf16` holds it in bfloat16 "
        "(half the bytes of fp32; its log-probs are computed in fp32), `same` in the model's dtype.",
    )
    recompute_granularity: Literal["none", "full"] = Field(
        default="none",
        description="Activation recompute: `full` keeps only each transformer layer's input for backward and "
        "recomputes the layer's activations there (torch.utils.checkpoint per layer); same loss and "
        "gradients, less activation memory, about one more forward of compute. `none` keeps them all.",
    )
    rendezvous: str | None = Field(
        default=None,
        pattern=r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):[0-9]{1,5}$",
        description="'host:port' of the c10d TCPStore where the data-parallel ranks meet (rank 0 hosts it, "
        "workers connect to it). None: torchrun's MASTER_ADDR/MASTER_PORT when both are set, else "
        "127.0.0.1 on a free port (embedded runs; every rank on this host).",
    )
    streaming: bool = Field(
        default=False,
        description="Stream each step: train it in parts (>= one scored group each, whole trees) pulled as "
        "groups are scored, up to batch_max_tokens, instead of pulling the whole batch first; the parts "
        "are re-normalised so the step equals one batch of the same groups (docs/trainer.md, 'Streaming').",
    )
    stream_wait_s: float = Field(
        default=2.0,
        ge=0,
        description="Streaming: how long a step waits for its next part (a newly scored group that fits) "
        "before it takes its optimizer step (s); the wait runs while the previous part trains.",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="Megatron tensor parallel ranks per replica (heads, MLP width and vocabulary split over "
        "them; the loss stays vocabulary-parallel). Must divide the model's attention heads, key/value "
        "heads, ffn_hidden_size and vocab_size. Each data-parallel replica is TP x CP worker processes, one "
        "per device: n devices held form floor(n / (TP x CP)) replicas, a leftover device waits "
        "(services/trainer/tp_replica.py); with a MasterAdamW (precision bf16 or optimizer_sharding "
        "zero1) each TP rank shards its own parameters over its data-parallel group and clipping uses the "
        "whole model's norm. Values > 1 need device cpu for now (docs/trainer.md, 'Parallelism').",
    )
    context_parallel_size: int = Field(
        default=1,
        ge=1,
        description="Context parallel ranks per replica: each holds a contiguous slice of every "
        "micro-batch's packed tokens, all-gathers keys and values over the group (gyre/model/parallel.py) "
        "and backpropagates the loss terms of the tokens it owns; gradients are summed over the CP group. "
        "A data-parallel replica is TP x CP worker processes, one per device: n devices held form "
        "floor(n / (TP x CP)) replicas, a leftover device waits (services/trainer/tp_replica.py). Values "
        "> 1 need device cpu for now (docs/trainer.md, 'Parallelism').",
    )

    @model_validator(mode="after")
    def _streaming_without_step_normalisation(self) -> TrainerConfig:
        if self.streaming and self.normalise_batch_advantages:
            raise ValueError(
                "trainer.streaming and trainer.normalise_batch_advantages cannot both be on: batch "
                "advantage normalisation divides by the RMS of the whole step's advantages, which a "
                "streamed step does not know when it trains its first part; turn one of them off"
            )
        problem = vocabulary_problem(self.tokenizer, self.model.vocab_size, "trainer.model.vocab_size")
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _model_parallel_sizes(self) -> TrainerConfig:
        tp, cp = self.tensor_parallel_size, self.context_parallel_size
        problem = tensor_parallel_problem(self.model, tp)
        if problem:
            raise ValueError(f"trainer.tensor_parallel_size: {problem}; pick a size that divides them all")
        if (tp > 1 or cp > 1) and self.device != "cpu":
            raise ValueError(
                f"trainer.tensor_parallel_size {tp} x context_parallel_size {cp}: model-parallel replicas "
                f"run on CPU/gloo only so far (device cpu; the NCCL path has not run); got device "
                f"{self.device} (docs/trainer.md, 'Parallelism')"
            )
        return self

    @model_validator(mode="after")
    def _kept_weight_versions_cover_the_staleness_bound(self) -> TrainerConfig:
        if self.keep_weight_versions and self.keep_weight_versions < self.max_staleness + 1:
            raise ValueError(
                f"trainer.keep_weight_versions {self.keep_weight_versions} would delete weight versions "
                f"the staleness bound can still use: keep at least max_staleness + 1 = "
                f"{self.max_staleness + 1}, or unset it (max_staleness + 2), or 0 to keep every version"
            )
        return self

    @model_validator(mode="after")
    def _bf16_masters_are_fp32(self) -> TrainerConfig:
        if self.precision == "bf16" and self.dtype != "float32":
            raise ValueError(
                f"trainer.precision bf16 keeps fp32 master weights, so trainer.dtype must be float32 (the "
                f"masters' dtype), not {self.dtype}; for pure {self.dtype} training set precision to fp32"
            )
        return self

    @property
    def weight_versions_kept(self) -> int | None:
        """How many newest weight versions stay on disk after a publish; None = all of them."""
        if self.keep_weight_versions is None:
            return self.max_staleness + 2
        return self.keep_weight_versions or None
