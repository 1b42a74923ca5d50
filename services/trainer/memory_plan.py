"""Memory plan of one trainer replica: pure arithmetic on a `ModelConfig`, no torch model is built.

Units: bytes everywhere (the CLI prints GiB = 2**30 bytes). Notation: N = parameter count,
V = vocab_size, h = hidden_size, L = num_layers, a = query heads, g = KV heads (GQA), d = head_dim,
f = ffn_hidden_size, T = tokens of one micro-batch on this replica, p = bytes per parameter and per
activation element (bf16 = 2, fp32 = 4), C = loss_chunk_tokens.

Parameter count N:
    embedding V*h (+ max_position_embeddings*h for learned positions)
    + output layer V*h unless tie_embeddings
    + per layer: attention q h*a*d, k and v h*g*d each, o a*d*h (+ a*d + 2*g*d qkv bias with
      add_qkv_bias or add_bias_linear, + h o bias with add_bias_linear);
      MLP 3*h*f with SwiGLU (gate, up, down), else 2*h*f (+ biases with add_bias_linear);
      two norms h each (x2 for LayerNorm's bias); qk_layernorm: 2*d (x2 for LayerNorm)
    + final norm h (x2 for LayerNorm).

State:
    params    = N * p                                (the compute copy)
    grads     = N * 4 with bf16 params and fp32_master (the trainer's MasterAdamW accumulates fp32
                main gradients and frees each bf16 gradient as it is folded in), else N * p
    optimizer = Adam: 2 fp32 moments 8*N, + fp32 master copy 4*N when p = bf16 and fp32_master;
                divided by dp_size when shard_optimizer (ZeRO-1, services/trainer/sharded_optimizer.py:
                whole parameters are assigned to ranks largest first, so a rank may hold up to one
                parameter's share more than 1/dp)
    reference = N * 2 with kl_reference (the KL reference model, held in bf16: trainer.kl_coef > 0
                with reference_precision bf16), else 0

Activations kept for backward, per token per layer (our attention is flash/flex: no T^2 score matrix,
so Megatron's s*b*h*(34 + 5*a*s/h) loses its 5*a*s/h term; the rest is recounted for RMSNorm,
SwiGLU, GQA and no dropout):
    A = p * (4*h                 two norm inputs + two norm outputs (= q/k/v and MLP matmul inputs)
             + 2*a*d + 2*g*d     q, k, v after RoPE + attention output (= o-projection input)
             + 4*f)              SwiGLU: gate and up outputs, silu(gate), their product (down input)
        + 4*a                    attention's fp32 log-sum-exp per head
        + p * (a*d + g*d)        only with qk_layernorm: q and k before their norms
    (plain GeLU MLP: 2*f instead of 4*f). For Llama-7B in bf16, A = 150 KiB = 37.5*h bytes,
    against Megatron's 34*h bytes for GPT-3's GeLU MLP with dropout.
    no recompute:  activations = T * L * A
    recompute:     activations = T * L * p*h (each layer's input) + T * A (one layer rebuilt in backward)

Loss (services/trainer/chunked_softmax.py keeps fp32 logits, log-softmax and probabilities of the
tokens it works on: about three V-wide fp32 rows per token):
    chunked: min(C, T) * V * 4 * 3          full: T * V * 4 * 3
    plus the final norm's input and output T * h * p * 2.

total = params + grads + optimizer + reference + activations + loss; fits = total <= device_bytes.

NOT counted: allocator fragmentation and caching slack (often 5-20%), the CUDA context and kernel
workspaces (cuBLAS, flash attention), NCCL communication buckets, gradient all-reduce buffers,
temporaries of one op (e.g. a matmul output freed before the next),
token ids / targets / advantages, pipeline parallelism (not modelled), and under CP the tree mask of
a rank's rows (T/CP x T booleans on CPU, a block mask on CUDA).

Tensor and context parallelism (`tp_size`, `cp_size`; a replica is TP x CP devices, the plan is one
of them; no sequence parallelism, as in the trainer):
    params, grads, optimizer, reference: per TP rank, N_r = (N - R) / TP + R, where R are the
                replicated parameters (norms, qk norms, learned positions, row-parallel biases);
                everything else (embedding/output rows, q/k/v, projections, MLP) is split
    activations: per CP rank t = ceil(T / CP) tokens; per token per layer
                A_r = p * (4*h + (2*a*d + 2*g*d + 4*f [+ a*d + g*d]) / TP) + 4*a / TP
                (norm inputs/outputs are whole on every TP rank); with CP > 1 each layer also keeps
                the all-gathered keys and values of the other ranks' tokens, (T - t) * p * 2*g*d / TP
                (under recompute: of the one layer rebuilt)
    loss:       vocabulary-parallel, min(C, t) * V/TP * 4 * 3, plus t * h * p * 2
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from gyre.model.config import ModelConfig, tensor_parallel_problem

GIB = 2**30
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp32": 4}
LOSS_FP32_COPIES = 3


def parameter_count(model: ModelConfig) -> int:
    """Number of parameters of the GPT described by `model` (formula in the module docstring)."""
    h, d, a, g, f = (
        model.hidden_size,
        model.head_dim,
        model.num_attention_heads,
        model.kv_heads,
        model.ffn_hidden_size,
    )
    norm = 2 if model.normalization == "LayerNorm" else 1
    count = model.vocab_size * h
    if model.position_embedding == "learned":
        count += model.max_position_embeddings * h
    if not model.tie_embeddings:
        count += model.vocab_size * h
    attention = h * a * d + 2 * h * g * d + a * d * h
    if model.add_qkv_bias or model.add_bias_linear:
        attention += a * d + 2 * g * d
    if model.add_bias_linear:
        attention += h
    if model.swiglu:
        mlp = 3 * h * f + (2 * f + h if model.add_bias_linear else 0)
    else:
        mlp = 2 * h * f + (f + h if model.add_bias_linear else 0)
    norms = 2 * h * norm + (2 * d * norm if model.qk_layernorm else 0)
    count += model.num_layers * (attention + mlp + norms)
    return count + h * norm


def replicated_parameter_count(model: ModelConfig) -> int:
    """Parameters every tensor-parallel rank holds whole: norms (qk norms included), learned
    positions, and the biases of the row-parallel projections (attention output, MLP fc2)."""
    h, d = model.hidden_size, model.head_dim
    norm = 2 if model.normalization == "LayerNorm" else 1
    count = model.max_position_embeddings * h if model.position_embedding == "learned" else 0
    per_layer = 2 * h * norm + (2 * d * norm if model.qk_layernorm else 0)
    if model.add_bias_linear:
        per_layer += 2 * h
    return count + model.num_layers * per_layer + h * norm


def rank_parameter_count(model: ModelConfig, tp_size: int = 1) -> int:
    """Parameters one tensor-parallel rank holds: the split ones (embedding and output rows, q/k/v,
    projections, MLP weights and their column-parallel biases) / TP, plus the replicated ones whole.
    TP must divide what it splits (`gyre.model.config.tensor_parallel_problem`)."""
    replicated = replicated_parameter_count(model)
    return (parameter_count(model) - replicated) // tp_size + replicated


def activation_bytes_per_token_layer(model: ModelConfig, act_bytes: int, tp_size: int = 1) -> int:
    """A: bytes one layer keeps for backward per token without recompute on one TP rank (module
    docstring): heads and MLP width are split over TP, the norms' inputs and outputs are not (no
    sequence parallelism)."""
    h, d, a, g, f = (
        model.hidden_size,
        model.head_dim,
        model.num_attention_heads,
        model.kv_heads,
        model.ffn_hidden_size,
    )
    mlp = 4 * f if model.swiglu else 2 * f
    split = 2 * a * d + 2 * g * d + mlp
    if model.qk_layernorm:
        split += a * d + g * d
    return act_bytes * (4 * h + split // tp_size) + 4 * a // tp_size


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one device of a trainer replica needs (one TP x CP rank; the whole replica when both
    are 1), by part, and whether they fit in `device_bytes`."""

    parameter_count: int
    params: int
    grads: int
    optimizer: int
    activations: int
    loss: int
    device_bytes: int
    tokens: int
    param_dtype: str
    fp32_master: bool
    dp_size: int
    shard_optimizer: bool
    recompute: bool
    loss_chunk_tokens: int | None
    reference: int = 0
    kl_reference: bool = False
    tp_size: int = 1
    cp_size: int = 1

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.reference + self.activations + self.loss

    @property
    def fits(self) -> bool:
        return self.total <= self.device_bytes

    def rows(self) -> list[tuple[str, int]]:
        """(part, bytes) rows in print order, ending with total and device."""
        return [
            ("params", self.params),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("reference", self.reference),
            ("activations", self.activations),
            ("loss", self.loss),
            ("total", self.total),
            ("device", self.device_bytes),
        ]

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "total": self.total, "fits": self.fits}


def plan_memory(
    model: ModelConfig,
    *,
    tokens: int,
    param_dtype: str,
    fp32_master: bool,
    optimizer: Literal["adam"] = "adam",
    dp_size: int = 1,
    shard_optimizer: bool = False,
    recompute: bool,
    loss_chunk_tokens: int | None,
    device_bytes: int,
    kl_reference: bool = False,
    tp_size: int = 1,
    cp_size: int = 1,
) -> MemoryPlan:
    """Memory of one device of a trainer replica training `tokens` tokens per micro-batch, the replica
    being TP x CP devices (module docstring); ValueError when TP does not divide the model."""
    if param_dtype not in DTYPE_BYTES:
        raise ValueError(f"param_dtype must be one of {sorted(DTYPE_BYTES)}, not {param_dtype!r}")
    if optimizer != "adam":
        raise ValueError(f"only the 'adam' optimizer is modelled, not {optimizer!r}")
    if tokens < 1 or dp_size < 1 or tp_size < 1 or cp_size < 1 or device_bytes < 0:
        raise ValueError("tokens, dp_size, tp_size and cp_size must be >= 1 and device_bytes >= 0")
    problem = tensor_parallel_problem(model, tp_size)
    if problem:
        raise ValueError(problem)
    if loss_chunk_tokens is not None and loss_chunk_tokens < 1:
        raise ValueError("loss_chunk_tokens must be >= 1 (or None for the full loss)")
    p = DTYPE_BYTES[param_dtype]
    n = parameter_count(model)
    n_rank = rank_parameter_count(model, tp_size)
    states = 8 * n_rank + (4 * n_rank if p == 2 and fp32_master else 0)
    if shard_optimizer:
        states = -(-states // dp_size)
    t = -(-tokens // cp_size)  # this CP rank's tokens
    per_layer = activation_bytes_per_token_layer(model, p, tp_size)
    # CP: each layer keeps the all-gathered keys and values of the other ranks' tokens too
    gathered_kv = (tokens - t) * p * 2 * model.kv_heads * model.head_dim // tp_size if cp_size > 1 else 0
    if recompute:
        activations = t * model.num_layers * p * model.hidden_size + t * per_layer + gathered_kv
    else:
        activations = model.num_layers * (t * per_layer + gathered_kv)
    loss_tokens = t if loss_chunk_tokens is None else min(loss_chunk_tokens, t)
    loss = loss_tokens * (model.vocab_size // tp_size) * 4 * LOSS_FP32_COPIES + t * model.hidden_size * p * 2
    return MemoryPlan(
        parameter_count=n,
        params=n_rank * p,
        grads=n_rank * (4 if p == 2 and fp32_master else p),
        optimizer=states,
        activations=activations,
        loss=loss,
        device_bytes=device_bytes,
        tokens=tokens,
        param_dtype=param_dtype,
        fp32_master=fp32_master,
        dp_size=dp_size,
        shard_optimizer=shard_optimizer,
        recompute=recompute,
        loss_chunk_tokens=loss_chunk_tokens,
        reference=2 * n_rank if kl_reference else 0,
        kl_reference=kl_reference,
        tp_size=tp_size,
        cp_size=cp_size,
    )
