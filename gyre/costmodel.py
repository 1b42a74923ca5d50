"""The accelerator cost model: how long decode, prefill, training and KV copies take on the modelled
hardware. Units: seconds, bytes, tokens, FLOPs.

One model, shared by the cluster simulator (services/scheduler/sim) and by paced devices (a logical
CPU device that takes as long as the modelled accelerator would). Every function is a closed-form
roofline; every default carries a tag saying where it comes from, as in
docs/cost-model-sources.md (cited below as "sources §n"):

- [S] the number is in a public source (named);
- [D] derived from published specs by the stated arithmetic;
- [G] assumed: a guess or a modelling choice. docs/simulator.md lists every [G] parameter with the
  ratios at +-50% of it (the sensitivity table).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """The policy model, as far as costs go."""

    params: float = Field(..., gt=0, description="Parameters N (dense, or active for MoE compute).")
    weight_bytes: float = Field(..., gt=0, description="Bytes of weights read per decode step (BF16: 2N).")
    kv_bytes_per_token: float = Field(
        ..., gt=0, description="KV cache bytes per token of context, all layers."
    )
    num_layers: int = Field(..., gt=0, description="Transformer layers (attention FLOPs).")
    attention_dim: int = Field(..., gt=0, description="Query heads x head dim (attention FLOPs).")


class HardwareSpec(_Strict):
    """One accelerator kind."""

    hbm_bytes: float = Field(..., gt=0, description="HBM per device (bytes).")
    hbm_bandwidth_bytes_s: float = Field(..., gt=0, description="HBM bandwidth per device (bytes/s).")
    bandwidth_efficiency: float = Field(
        default=0.8, gt=0, le=1, description="Achieved share of HBM bandwidth in decode."
    )
    peak_flops: float = Field(..., gt=0, description="Dense BF16 peak per device (FLOP/s).")
    migration_bandwidth_bytes_s: float = Field(
        ..., gt=0, description="KV copy bandwidth between two engines (bytes/s)."
    )
    host_bandwidth_bytes_s: float = Field(
        default=50e9,
        gt=0,
        description="KV copy bandwidth between one engine and host memory (bytes/s): offload and reload.",
    )
    kv_memory_reserve: float = Field(
        default=0.1, ge=0, lt=1, description="Share of HBM kept for activations, graphs, fragmentation."
    )


class CostSpec(_Strict):
    """Costs of training, switching, syncing and migrating."""

    train_mfu: float = Field(default=0.40, gt=0, le=1, description="Model FLOPs utilization of training.")
    prefill_mfu: float = Field(
        default=0.40, gt=0, le=1, description="Model FLOPs utilization of incremental prefill."
    )
    switch_rollout_to_train_s: float = Field(
        default=10.0, ge=0, description="Whole-pool switch rollout -> train (s)."
    )
    switch_train_to_rollout_s: float = Field(
        default=10.0, ge=0, description="Whole-pool switch train -> rollout incl. refit (s)."
    )
    elastic_role_change_s: float = Field(
        default=15.0, ge=0, description="One engine unit changing role inside a running job (s)."
    )
    weight_sync_s: float = Field(
        default=2.5, ge=0, description="Pushing a new version to rollout engines, engines stall (s)."
    )
    migration_overhead_s: float = Field(
        default=0.15, ge=0, description="Control overhead of one live migration (s)."
    )
    planning_context_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description=(
            "Engine max batch (`engine_capacity`, the operator's engine_max_batch) is sized for this share of "
            "the mean final context; admission itself is against each execution's actual KV size."
        ),
    )
    train_microbatch_tokens: float = Field(
        default=65_536,
        gt=0,
        description="Tokens of one trainer micro-batch per data-parallel replica (resize granularity).",
    )


class CostModel:
    """Per-unit costs of one deployment: `devices_per_unit` devices form one engine (TP group) or one
    data-parallel trainer replica."""

    def __init__(
        self, model: ModelSpec, hardware: HardwareSpec, costs: CostSpec, devices_per_unit: int
    ) -> None:
        if devices_per_unit < 1:
            raise ValueError(f"devices_per_unit must be >= 1, got {devices_per_unit}")
        self.model = model
        self.hardware = hardware
        self.costs = costs
        self.devices_per_unit = devices_per_unit
        # Hot-path constants (the simulator prices every turn).
        self._unit_bandwidth = (
            devices_per_unit * hardware.hbm_bandwidth_bytes_s * hardware.bandwidth_efficiency
        )
        self._kv_per_token = model.kv_bytes_per_token
        self._weights = model.weight_bytes
        self._prefill_flops_s = devices_per_unit * hardware.peak_flops * costs.prefill_mfu
        self._attn = 4 * model.num_layers * model.attention_dim

    def kv_bytes(self, context_tokens: float) -> float:
        """KV cache bytes of one sequence of `context_tokens` tokens."""
        return self._kv_per_token * context_tokens

    def kv_budget_bytes(self) -> float:
        """KV bytes one engine unit can hold: its HBM less the reserve and the weights [D]."""
        hw = self.hardware
        return hw.hbm_bytes * self.devices_per_unit * (1 - hw.kv_memory_reserve) - self.model.weight_bytes

    def engine_capacity(self, mean_final_context: float) -> int:
        """The engine max batch an operator would configure: the KV budget over the KV of the
        time-averaged context (planning_context_share x mean final context). At least 1."""
        per_exec = self.kv_bytes(self.costs.planning_context_share * mean_final_context)
        return max(1, math.floor(self.kv_budget_bytes() / per_exec))

    def decode_step_s(self, decoding_context_tokens: float) -> float:
        """One decode step of an engine: memory-bound, reads the weights once and the KV of every
        sequence in the batch (sources §2: t = (W + sum KV(c)) / (eta * BW), over the TP group)."""
        return (self._weights + self._kv_per_token * decoding_context_tokens) / self._unit_bandwidth

    def prefill_s(self, new_tokens: float, context_tokens: float) -> float:
        """Incremental prefill of `new_tokens` on top of `context_tokens` cached ones (compute-bound):
        2N per token + 4 * layers * attention_dim * (context + new/2) per token (sources §3)."""
        flops = new_tokens * (2 * self.model.params + self._attn * (context_tokens + new_tokens / 2))
        return flops / self._prefill_flops_s

    def train_flops(self, context_tokens: float) -> float:
        """FLOPs to train on one sequence of length L: 6NL + 6 * layers * attention_dim * L^2
        (dense forward+backward plus causal attention; sources §3)."""
        m = self.model
        return 6 * m.params * context_tokens + 6 * m.num_layers * m.attention_dim * context_tokens**2

    def train_flops_per_s(self, num_devices: int) -> float:
        """Training FLOP/s of `num_devices` devices at `train_mfu`."""
        return num_devices * self.hardware.peak_flops * self.costs.train_mfu

    def migration_s(self, context_tokens: float) -> float:
        """Copying one sequence's KV cache to another engine plus control overhead (sources §5)."""
        return (
            self.kv_bytes(context_tokens) / self.hardware.migration_bandwidth_bytes_s
            + self.costs.migration_overhead_s
        )

    def offload_s(self, context_tokens: float) -> float:
        """Copying one sequence's KV cache between an engine and host memory, one way."""
        return self.kv_bytes(context_tokens) / self.hardware.host_bandwidth_bytes_s


# --- built-in models and hardware -------------------------------------------------------------------------

# Qwen3-32B-like dense model [D]: 64 layers, 8 KV heads x 128 head dim x 2 (K,V) x 2 bytes = 256 KiB/token;
# 64 query heads x 128 = 8192 attention dim (sources §4: config recalled, not verified).
MODEL_32B = ModelSpec(
    params=32e9, weight_bytes=64e9, kv_bytes_per_token=262_144, num_layers=64, attention_dim=8192
)
# Llama-3-8B-like model [D]: 32 layers x 8 KV heads x 128 x 2 x 2 bytes = 128 KiB/token; 32 x 128 = 4096.
MODEL_8B = ModelSpec(
    params=8e9, weight_bytes=16e9, kv_bytes_per_token=131_072, num_layers=32, attention_dim=4096
)

# H200 SXM: 141 GB HBM3e, 4.8 TB/s [S: NVIDIA MLPerf system file, sources §1]; 989 TFLOP/s dense BF16
# [G: spec memory, sources §1]; bandwidth efficiency 0.8 [G, sources §2 says 0.7-0.85]; engine-to-engine
# KV copy over 4 x 400 Gb/s NICs = 200 GB/s [D from S: 10 x 400 Gb/s IB per node, sources §1]; host copies
# at 50 GB/s per unit [G: PCIe Gen5 x16 effective, sources §1]; 10% of HBM reserved [G].
H200 = HardwareSpec(
    hbm_bytes=141e9,
    hbm_bandwidth_bytes_s=4.8e12,
    bandwidth_efficiency=0.8,
    peak_flops=989e12,
    migration_bandwidth_bytes_s=200e9,
    host_bandwidth_bytes_s=50e9,
    kv_memory_reserve=0.1,
)

# Costs [sources §3, §6]: train MFU 0.40 [S: Megatron-Core up to 47% on H100, lowered for long contexts: G];
# prefill MFU 0.40 [G]; colocate switches 10 s each way [S: vLLM sleep L1 1-6 s + trainer onload 1-15 s
# (NeMo-RL), midpoints]; elastic role change of one unit 15 s [G: sources §6 gives 2-20 s]; weight sync 2.5 s
# [D: 64 GB / 50 GB/s + ~1 s overhead]; migration overhead 0.15 s [D: 50-200 ms control]; micro-batch 64K
# tokens [G: the trajectory service's default max_batch_tokens].
DEFAULT_COSTS = CostSpec()
