"""Build the shared megatron-core `GPTModel` on any device (CPU included).

The Megatron glue (parallel state, TransformerConfig, our core attention) is gyre.model.megatron,
imported on the first build so that importing this module stays light."""

from __future__ import annotations

from typing import Any

import torch

from gyre.model.config import ModelConfig


def build_model(
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
) -> Any:
    """A megatron-core `GPTModel` (local layer spec, our core attention), on `device` in `dtype`.

    Under Megatron tensor parallelism (`gyre.model.parallel.init_model_parallel`) the layers hold this
    rank's shard (heads, MLP width, vocabulary rows); `model.gyre_parallel` records the layout. With a
    seed, a rank's shard is not the same slice of a TP = 1 model's weights: load those with
    `gyre.model.tp_shard.load_full_weights`.

    `seed` (optional) makes the random initialisation reproducible: the same weights for the same
    config and seed in every process, and in every thread however many builds run at once (builds
    are serialised; the seeded draw happens on a forked CPU RNG, so the caller's global RNG state
    is left as it was). Run it with the functions of `gyre.model.forward` / `gyre.model.kv_cache`
    (they take each token's position id); Megatron's own `GPTModel.forward` computes RoPE from the sequence index and asks CUDA for it.
    """
    from gyre.model.megatron import BUILD_LOCK, GyreCoreAttention, ensure_model_parallel, transformer_config
    from gyre.model.parallel import current_model_parallel

    ensure_model_parallel()
    parallel = current_model_parallel()
    check_tensor_parallel(cfg, parallel.tp_size)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization=cfg.normalization, qk_layernorm=cfg.qk_layernorm)
    spec.submodules.self_attention.submodules.core_attention = GyreCoreAttention
    with BUILD_LOCK, torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        model = GPTModel(
            transformer_config(cfg, parallel.tp_size),
            spec,
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_position_embeddings,
            position_embedding_type="rope" if cfg.position_embedding == "rope" else "learned_absolute",
            rotary_base=int(cfg.rotary_base),
            share_embeddings_and_output_weights=cfg.tie_embeddings,
        )
    model.gyre_config = cfg
    model.gyre_parallel = parallel
    return model.to(device=torch.device(device), dtype=dtype)


def check_tensor_parallel(cfg: ModelConfig, tp_size: int) -> None:
    """InvalidArgument unless `cfg` splits evenly over `tp_size` ranks (`tensor_parallel_problem`)."""
    from gyre.errors import InvalidArgument
    from gyre.model.config import tensor_parallel_problem

    problem = tensor_parallel_problem(cfg, tp_size)
    if problem:
        raise InvalidArgument(problem)


def model_config_of(model: Any) -> ModelConfig:
    """The ModelConfig a model was built from."""
    cfg = getattr(model, "gyre_config", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError("model was not built by gyre.model.build_model")
    return cfg
