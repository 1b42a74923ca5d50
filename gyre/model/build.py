"""Build the shared megatron-core `GPTModel` on any device (CPU included)."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

from gyre.model.config import ModelConfig


def _quiet_megatron_import() -> None:
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")


_PARALLEL_INIT_LOCK = threading.Lock()
# One model is initialised at a time in a process: initialisation draws from torch's global RNG,
# and engines start in worker threads, so two seeded builds at once interleaved their draws and
# every engine got other weights than the trainer's version 0 (seen as KL ~2 at the first step).
_BUILD_LOCK = threading.Lock()


def ensure_model_parallel() -> None:
    """Initialise torch.distributed (gloo, world of 1) and Megatron's parallel state (TP = PP = 1).

    Safe to call any number of times, from any thread (a lock makes concurrent first calls one: two
    engines started at once used to fail with "pipeline model parallel group is already
    initialized"). The trainer's elastic data-parallel group is a separate process group
    (services.trainer.elastic), so this world of one never changes size.
    """
    import torch.distributed as dist

    _quiet_megatron_import()
    from megatron.core import parallel_state

    with _PARALLEL_INIT_LOCK:  # engines start in worker threads, possibly two at once
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1
            )


def transformer_config(cfg: ModelConfig) -> Any:
    """The megatron `TransformerConfig` matching `cfg` (float32 parameters, no dropout, no fusions)."""
    import torch.nn.functional as F

    _quiet_megatron_import()
    from megatron.core.transformer.transformer_config import TransformerConfig

    tc = TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.kv_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.head_dim,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=cfg.swiglu,
        activation_func=F.silu if cfg.swiglu else F.gelu,
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_std,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    tc.gyre_attention_backend = cfg.attention_backend  # read by GyreCoreAttention
    return tc


def build_model(
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
) -> Any:
    """A megatron-core `GPTModel` (local layer spec, our core attention), on `device` in `dtype`.

    `seed` (optional) makes the random initialisation reproducible: the same weights for the same
    config and seed in every process, and in every thread however many builds run at once (builds
    are serialised; the seeded draw happens on a forked CPU RNG, so the caller's global RNG state
    is left as it was). Run it with the functions of `gyre.model.forward` / `gyre.model.kv_cache` (they take each token's position id); Megatron's
    own `GPTModel.forward` computes RoPE from the sequence index and asks CUDA for it.
    """
    ensure_model_parallel()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from gyre.model.attention import GyreCoreAttention

    spec = get_gpt_layer_local_spec(normalization=cfg.normalization)
    spec.submodules.self_attention.submodules.core_attention = GyreCoreAttention
    with _BUILD_LOCK, torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        model = GPTModel(
            transformer_config(cfg),
            spec,
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_position_embeddings,
            position_embedding_type="rope" if cfg.position_embedding == "rope" else "learned_absolute",
            rotary_base=int(cfg.rotary_base),
            share_embeddings_and_output_weights=cfg.tie_embeddings,
        )
    model.gyre_config = cfg
    return model.to(device=torch.device(device), dtype=dtype)


def model_config_of(model: Any) -> ModelConfig:
    """The ModelConfig a model was built from."""
    cfg = getattr(model, "gyre_config", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError("model was not built by gyre.model.build_model")
    return cfg
