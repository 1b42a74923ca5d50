"""Cost model of the simulator: decode, prefill, training, migration. Units: seconds, bytes, tokens, FLOPs.

Every function is a closed-form roofline; the assumptions are stated where they are made and
collected in docs/simulator.md. Sources of the constants live in workload.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.scheduler.sim.workload import Workload


@dataclass(frozen=True)
class CostModel:
    """Precomputed per-unit constants of one workload."""

    workload: Workload
    mean_final_context: float

    @property
    def _unit_bandwidth(self) -> float:
        hw = self.workload.hardware
        return self.workload.devices_per_unit * hw.hbm_bandwidth_bytes_s * hw.bandwidth_efficiency

    def engine_slots(self) -> int:
        """Executions one engine unit hosts at once: the KV budget over the KV of the time-averaged
        context (planning_context_share x mean final context) [D]. At least 1."""
        w = self.workload
        budget = (
            w.hardware.hbm_bytes * w.devices_per_unit * (1 - w.hardware.kv_memory_reserve)
            - w.model.weight_bytes
        )
        per_exec = w.model.kv_bytes_per_token * w.costs.planning_context_share * self.mean_final_context
        return max(1, math.floor(budget / per_exec))

    def decode_step_s(self, decoding_context_tokens: float) -> float:
        """One decode step of an engine: memory-bound, reads the weights once and the KV of every
        sequence in the batch (reference §3.4: t = (W + sum KV(c)) / (eta * BW), over the TP group)."""
        m = self.workload.model
        return (m.weight_bytes + m.kv_bytes_per_token * decoding_context_tokens) / self._unit_bandwidth

    def prefill_s(self, new_tokens: float, context_tokens: float) -> float:
        """Incremental prefill of `new_tokens` on top of `context_tokens` cached ones (compute-bound):
        2N per token + 4 * layers * attention_dim * (context + new/2) per token (reference §6.2)."""
        w = self.workload
        m = w.model
        flops = new_tokens * (
            2 * m.params + 4 * m.num_layers * m.attention_dim * (context_tokens + new_tokens / 2)
        )
        return flops / (w.devices_per_unit * w.hardware.peak_flops * w.costs.prefill_mfu)

    def train_flops(self, context_tokens: float) -> float:
        """FLOPs to train on one execution of final length L: 6NL + 6 * layers * attention_dim * L^2
        (dense forward+backward plus causal attention; reference §3.5)."""
        m = self.workload.model
        return 6 * m.params * context_tokens + 6 * m.num_layers * m.attention_dim * context_tokens**2

    def train_flops_per_s(self, num_devices: int) -> float:
        hw = self.workload.hardware
        return num_devices * hw.peak_flops * self.workload.costs.train_mfu

    def migration_s(self, context_tokens: float) -> float:
        """Copying one execution's KV cache to another engine plus control overhead (reference §3.3)."""
        w = self.workload
        return (
            w.model.kv_bytes_per_token * context_tokens / w.hardware.migration_bandwidth_bytes_s
            + w.costs.migration_overhead_s
        )
