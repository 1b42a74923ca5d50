"""The Megatron glue of the shared model: quiet imports, the parallel state, the TransformerConfig
and our core-attention module that Megatron's layer spec takes.

Imports point one way: `gyre.model.attention` (pure torch masks and kernels) <- this module <-
`gyre.model.build` (builds the GPTModel from the spec with `GyreCoreAttention` in it).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

from gyre.model.attention import attend
from gyre.model.config import ModelConfig


def quiet_megatron_import() -> None:
    """Silence the warnings megatron-core prints at import on a host without Transformer Engine or Apex."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")


_PARALLEL_INIT_LOCK = threading.Lock()
# One model is initialised at a time in a process: initialisation draws from torch's global RNG,
# and engines start in worker threads, so two seeded builds at once interleaved their draws and
# every engine got other weights than the trainer's version 0 (seen as KL ~2 at the first step).
BUILD_LOCK = threading.Lock()


def ensure_model_parallel() -> None:
    """Initialise torch.distributed (gloo, world of 1) and Megatron's parallel state (TP = PP = 1).

    Safe to call any number of times, from any thread (a lock makes concurrent first calls one: two
    engines started at once used to fail with "pipeline model parallel group is already
    initialized"). The trainer's elastic data-parallel group is a separate process group
    (services.trainer.dp_group), so this world of one never changes size.
    """
    import torch.distributed as dist

    quiet_megatron_import()
    from megatron.core import parallel_state

    with _PARALLEL_INIT_LOCK:  # engines start in worker threads, possibly two at once
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1
            )


def transformer_config(cfg: ModelConfig, tensor_parallel_size: int = 1) -> Any:
    """The megatron `TransformerConfig` matching `cfg` (float32 parameters, no dropout, no fusions),
    for a model whose layers are split over `tensor_parallel_size` ranks (no sequence parallelism:
    gloo has the collectives, but Megatron's sequence gather allocates on CUDA). Context parallelism
    is not Megatron's here (gyre.model.parallel), so the config keeps context_parallel_size = 1."""
    import torch.nn.functional as F

    quiet_megatron_import()
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
        qk_layernorm=cfg.qk_layernorm,
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
        tensor_model_parallel_size=tensor_parallel_size,
    )
    tc.gyre_attention_backend = cfg.attention_backend  # read by GyreCoreAttention
    return tc


def _megatron_module_base() -> type:
    quiet_megatron_import()
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class GyreCoreAttention(_megatron_module_base()):  # type: ignore[misc]
    """Megatron core-attention module (drop-in for the local spec's DotProductAttention).

    Megatron's own one asks CUDA for its buffers; this one runs on any device and takes our mask
    objects (`TreeLayout`, `DenseMask`, None = causal) as `attention_mask`. Inputs follow Megatron:
    query [Sq, B, H, d], key/value [Sk, B, Hkv, d]; output [Sq, B, H * d].
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.backend = getattr(config, "gyre_attention_backend", "auto")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = attend(q, k, v, attention_mask, self.backend)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
