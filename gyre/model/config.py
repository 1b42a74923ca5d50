"""`ModelConfig`: the shape of the Megatron GPT that the trainer trains and the torch engine serves.

Pure pydantic (no torch import), so service configs can embed it and stay light to load. The
defaults are a tiny CPU model (2 layers, hidden 64) that fits the byte-level tokenizer
(`vocab_size=512`). Llama / Qwen2 checkpoints map onto it through `services.trainer.hf`:
RoPE (optionally Llama-3.1 scaled) + RMSNorm + SwiGLU + grouped-query attention + optional tied
embeddings, qkv bias (Qwen2) and per-head q/k norms (Qwen3).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gyre.config import ConfigModel


class ModelConfig(ConfigModel):
    """Architecture of the shared GPT model (megatron-core `GPTModel`, local layer spec)."""

    vocab_size: int = Field(default=512, ge=1, description="Number of token ids (embedding rows and logits).")
    num_layers: int = Field(default=2, ge=1, description="Number of transformer layers.")
    hidden_size: int = Field(default=64, ge=1, description="Width of the residual stream.")
    num_attention_heads: int = Field(default=4, ge=1, description="Query heads per layer.")
    kv_channels: int | None = Field(
        default=None,
        ge=1,
        description="Channels per attention head (HF `head_dim`); None = hidden_size / num_attention_heads. "
        "Set it when heads * head_dim differs from hidden_size (e.g. Qwen3).",
    )
    num_query_groups: int | None = Field(
        default=None,
        ge=1,
        description="Key/value heads (grouped-query attention); None = num_attention_heads (plain multi-head).",
    )
    ffn_hidden_size: int = Field(
        default=256, ge=1, description="Inner width of the MLP (of each half when SwiGLU)."
    )
    max_position_embeddings: int = Field(
        default=4096,
        ge=1,
        description="Largest position id + 1 the model accepts (tokens; learned positions' table size).",
    )
    position_embedding: Literal["rope", "learned"] = Field(
        default="rope",
        description="'rope': rotary embeddings computed from each token's own position id; "
        "'learned': a learned absolute position table indexed by position id.",
    )
    rotary_base: float = Field(default=10000.0, gt=0, description="RoPE base (theta); Llama-3 uses 500000.")
    rope_scaling: Literal["none", "llama3"] = Field(
        default="none",
        description="RoPE frequency scaling: 'none' = plain rotary embedding; 'llama3' = Llama 3.1's "
        "(HF rope_type 'llama3'): low frequencies divided by rope_scaling_factor, high ones kept, "
        "the band between smoothly interpolated.",
    )
    rope_scaling_factor: float = Field(
        default=8.0, gt=0, description="'llama3' scaling: divisor of the low frequencies (HF `factor`)."
    )
    rope_low_freq_factor: float = Field(
        default=1.0,
        gt=0,
        description="'llama3' scaling: wavelengths above original_max / this are scaled (HF `low_freq_factor`).",
    )
    rope_high_freq_factor: float = Field(
        default=4.0,
        gt=0,
        description="'llama3' scaling: wavelengths below original_max / this are kept (HF `high_freq_factor`).",
    )
    rope_original_max_position_embeddings: int = Field(
        default=8192,
        ge=1,
        description="'llama3' scaling: context length the model was pretrained with "
        "(HF `original_max_position_embeddings`).",
    )
    normalization: Literal["RMSNorm", "LayerNorm"] = Field(
        default="RMSNorm", description="Norm of every layer and the final norm."
    )
    norm_epsilon: float = Field(default=1e-5, gt=0, description="Epsilon of the norms.")
    swiglu: bool = Field(default=True, description="Gated SiLU MLP (Llama); False = plain GeLU MLP (GPT-2).")
    add_bias_linear: bool = Field(default=False, description="Biases on every linear layer (GPT-2 style).")
    add_qkv_bias: bool = Field(
        default=False, description="Bias on the fused q/k/v projection only (Qwen2 style)."
    )
    qk_layernorm: bool = Field(
        default=False,
        description="Per-head norm (of the `normalization` kind, weights [head_dim]) on queries and keys "
        "before RoPE (Qwen3 style: q_norm / k_norm).",
    )
    tie_embeddings: bool = Field(
        default=False, description="Share the input embedding matrix with the output layer."
    )
    init_std: float = Field(
        default=0.02, gt=0, description="Standard deviation of the random weight initialisation."
    )
    attention_backend: Literal["auto", "dense", "nodes", "flex"] = Field(
        default="auto",
        description="Kernel for tree-masked attention: 'dense' = torch SDPA with a boolean [T,T] mask; "
        "'nodes' = one SDPA call per group of same-shaped tree nodes over their ancestors' keys (no wasted work, CPU friendly); "
        "'flex' = torch flex attention with a block mask (CUDA); 'auto' = flex on CUDA, else nodes for "
        "large trees with few nodes and dense otherwise. All are exact; see docs/model.md.",
    )

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be divisible by num_attention_heads {self.num_attention_heads}"
            )
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of num_query_groups {groups}"
            )
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(
                "RoPE needs an even head dimension (kv_channels or hidden_size / num_attention_heads)"
            )
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(
                f"rope_high_freq_factor {self.rope_high_freq_factor} must exceed rope_low_freq_factor "
                f"{self.rope_low_freq_factor}"
            )
        return self

    @property
    def head_dim(self) -> int:
        """Channels per attention head (kv_channels, defaulting to hidden_size / num_attention_heads)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (num_query_groups, defaulting to num_attention_heads)."""
        return self.num_query_groups or self.num_attention_heads


def tensor_parallel_problem(cfg: ModelConfig, tp_size: int) -> str | None:
    """Why `cfg` cannot be split over `tp_size` tensor-parallel ranks (None when it can): Megatron
    splits query heads, key/value heads (each rank holds whole query groups), the MLP width and the
    vocabulary rows evenly."""
    sizes = {
        "num_attention_heads": cfg.num_attention_heads,
        "key/value heads (num_query_groups)": cfg.kv_heads,
        "ffn_hidden_size": cfg.ffn_hidden_size,
        "vocab_size": cfg.vocab_size,
    }
    bad = [f"{name} {value}" for name, value in sizes.items() if value % tp_size]
    return f"tensor parallel size {tp_size} must divide the model's {', '.join(bad)}" if bad else None
