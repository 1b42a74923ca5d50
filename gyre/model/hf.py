"""Hugging Face interop: import a Llama / Qwen2 / Qwen3-style checkpoint into our Megatron model and export back.

Shared by the trainer (it starts training from the checkpoint) and the rollout torch engine (it
serves the same weights as version 0), so it lives in the runtime, beside the model definition.

A checkpoint directory holds `config.json` and `*.safetensors` (what `save_pretrained` writes and
vLLM serves). Mapping (per layer i, Megatron names on the left):

    embedding.word_embeddings              <- model.embed_tokens
    decoder.layers.i.input_layernorm       <- model.layers.i.input_layernorm
    ...self_attention.linear_qkv (+bias)   <- q_proj, k_proj, v_proj interleaved per key/value group:
                                              [q heads of group g, k_g, v_g] for g = 0..groups-1
    ...self_attention.q_layernorm          <- q_norm   (Qwen3 only: per-head RMSNorm, [head_dim])
    ...self_attention.k_layernorm          <- k_norm   (Qwen3 only)
    ...self_attention.linear_proj          <- o_proj
    decoder.layers.i.pre_mlp_layernorm     <- post_attention_layernorm
    ...mlp.linear_fc1                      <- cat(gate_proj, up_proj)   (SwiGLU: silu(first half) * second)
    ...mlp.linear_fc2                      <- down_proj
    decoder.final_layernorm                <- model.norm
    output_layer                           <- lm_head (absent when tie_word_embeddings)

Supported: RoPE, plain ("default" rope type) or Llama-3.1 scaled ("llama3", every parameter taken
from the config), RMSNorm, SwiGLU, any head_dim (Qwen3's heads * head_dim != hidden maps to
kv_channels), full attention; anything else (other rope types, sliding windows, partial rotary,
MLP or o_proj biases) is refused with a clear error rather than imported wrongly. Tensors keep
their values exactly (a float32 round trip import -> export is bit-identical); the model's own
dtype applies on load.

The checkpoint's tokenizer is NOT used: Gyre tokenises with its byte tokenizer (gyre/tokenizer.py),
so token ids 0..266 mean bytes and Gyre's specials whatever the checkpoint was trained on. A real
pretrained checkpoint therefore runs and trains, but starts from weights that do not know these ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gyre.errors import InvalidArgument
from gyre.model import ModelConfig, build_model

_SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# keys a rope_parameters / rope_scaling mapping may hold, per rope type
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "llama3": {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    },
}


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig rope fields for an HF config (InvalidArgument naming an unsupported rope type or key)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in _ROPE_KEYS:
        raise InvalidArgument(
            f"rope type {kind!r} is not supported (supported: {sorted(_ROPE_KEYS)}); rope parameters {rope!r}"
        )
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise InvalidArgument("partial_rotary_factor other than 1.0 is not supported")
    extra = sorted(set(rope) - _ROPE_KEYS[kind] - {"partial_rotary_factor"})
    if extra:
        raise InvalidArgument(f"rope type {kind!r}: parameters {extra} are not supported")
    fields: dict[str, Any] = {"rotary_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if kind == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if key not in rope:
                raise InvalidArgument(f"rope type 'llama3' needs {key!r}; rope parameters {rope!r}")
        fields.update(
            rope_scaling="llama3",
            rope_scaling_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings", hf.get("max_position_embeddings", 4096))
            ),
        )
        if fields["rope_high_freq_factor"] <= fields["rope_low_freq_factor"]:
            raise InvalidArgument("rope type 'llama3': high_freq_factor must exceed low_freq_factor")
    return fields


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Our ModelConfig for an HF config.json mapping (InvalidArgument for what we cannot represent)."""
    kind = hf.get("model_type")
    if kind not in _SUPPORTED:
        raise InvalidArgument(f"model_type {kind!r} is not supported; supported: {sorted(_SUPPORTED)}")
    rope = _rope_fields(hf)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim % 2:
        raise InvalidArgument(f"head_dim {head_dim} must be even for RoPE")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias", False):
        raise InvalidArgument("only SwiGLU MLPs without bias are supported")
    attention_bias = bool(hf.get("attention_bias", False))
    if kind in ("llama", "qwen3") and attention_bias:
        raise InvalidArgument(f"{kind} attention_bias (bias on o_proj too) is not supported")
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise InvalidArgument("sliding-window attention (use_sliding_window / layer_types) is not supported")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        kv_channels=None if head_dim * heads == hf["hidden_size"] else head_dim,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        position_embedding="rope",
        **rope,
        normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=kind == "qwen2" or attention_bias,
        qk_layernorm=kind == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def hf_config_from_model(cfg: ModelConfig, model_type: str = "llama") -> dict[str, Any]:
    """config.json content for our model: Qwen3 with q/k norms, Qwen2 with a qkv bias, else Llama."""
    if not (
        cfg.position_embedding == "rope"
        and cfg.normalization == "RMSNorm"
        and cfg.swiglu
        and not cfg.add_bias_linear
    ):
        raise InvalidArgument(
            "only RoPE + RMSNorm + SwiGLU models without linear biases export to Llama/Qwen2/Qwen3"
        )
    if cfg.qk_layernorm and cfg.add_qkv_bias:
        raise InvalidArgument("q/k norms together with a qkv bias (and no o_proj bias) have no HF model type")
    if cfg.qk_layernorm:
        model_type = "qwen3"
    elif cfg.add_qkv_bias:
        model_type = "qwen2"
    rope: dict[str, Any] = {"rope_theta": cfg.rotary_base, "rope_type": "default"}
    if cfg.rope_scaling == "llama3":
        rope.update(
            rope_type="llama3",
            factor=cfg.rope_scaling_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
        )
    out: dict[str, Any] = {
        "architectures": [_SUPPORTED[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_epsilon,
        "rope_theta": cfg.rotary_base,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    if model_type == "qwen3":
        out.update(use_sliding_window=False, sliding_window=None)
    return out


def hf_to_megatron(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename and fuse an HF state dict into Megatron's parameter names."""
    g, per = cfg.kv_heads, cfg.num_attention_heads // cfg.kv_heads
    d = cfg.head_dim
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for suffix in ("weight", "bias") if cfg.add_qkv_bias else ("weight",):
            q = hf[src + f"self_attn.q_proj.{suffix}"].reshape(g, per * d, -1)
            k = hf[src + f"self_attn.k_proj.{suffix}"].reshape(g, d, -1)
            v = hf[src + f"self_attn.v_proj.{suffix}"].reshape(g, d, -1)
            fused = torch.cat([q, k, v], dim=1).reshape((per + 2) * d * g, -1)
            out[dst + f"self_attention.linear_qkv.{suffix}"] = (
                fused.squeeze(-1) if suffix == "bias" else fused
            )
        if cfg.qk_layernorm:
            out[dst + "self_attention.q_layernorm.weight"] = hf[src + "self_attn.q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = hf[src + "self_attn.k_norm.weight"]
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "self_attention.linear_proj.weight"] = hf[src + "self_attn.o_proj.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]]
        )
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not cfg.tie_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def megatron_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of hf_to_megatron."""
    g, per = cfg.kv_heads, cfg.num_attention_heads // cfg.kv_heads
    d = cfg.head_dim
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"]}
    for i in range(cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for suffix in ("weight", "bias") if cfg.add_qkv_bias else ("weight",):
            fused = state[src + f"self_attention.linear_qkv.{suffix}"]
            grouped = fused.reshape(g, (per + 2) * d, -1)
            q, k, v = grouped.split([per * d, d, d], dim=1)
            for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                flat = t.reshape(-1, t.shape[-1])
                out[dst + f"self_attn.{name}.{suffix}"] = flat.squeeze(-1) if suffix == "bias" else flat
        if cfg.qk_layernorm:
            out[dst + "self_attn.q_norm.weight"] = state[src + "self_attention.q_layernorm.weight"]
            out[dst + "self_attn.k_norm.weight"] = state[src + "self_attention.k_layernorm.weight"]
        out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
        out[dst + "self_attn.o_proj.weight"] = state[src + "self_attention.linear_proj.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "pre_mlp_layernorm.weight"]
        gate, up = state[src + "mlp.linear_fc1.weight"].chunk(2)
        out[dst + "mlp.gate_proj.weight"] = gate
        out[dst + "mlp.up_proj.weight"] = up
        out[dst + "mlp.down_proj.weight"] = state[src + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["output_layer.weight"]
    return out


# fields of ModelConfig that a checkpoint does not determine
_NOT_IN_CHECKPOINT = {"init_std", "attention_backend"}


def read_hf_config(path: str | Path) -> ModelConfig:
    """Our ModelConfig for the HF checkpoint directory `path` (its config.json)."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise InvalidArgument(f"{path} is not an HF checkpoint directory: no config.json")
    try:
        hf = json.loads(config.read_text())
    except ValueError as exc:
        raise InvalidArgument(f"{config}: not JSON ({exc})") from exc
    return model_config_from_hf(hf)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if not tensors:
        raise InvalidArgument(f"no *.safetensors files in {path}")
    return tensors


def _copy_into(model: Any, state: dict[str, torch.Tensor], cfg: ModelConfig, where: Path) -> None:
    own = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
    if cfg.tie_embeddings:
        own.pop("output_layer.weight", None)
    if set(own) != set(state):
        raise InvalidArgument(f"checkpoint {where} does not fit: missing {sorted(set(own) - set(state))[:5]}")
    with torch.no_grad():
        for name, t in state.items():
            if own[name].shape != t.shape:
                raise InvalidArgument(
                    f"{where}: {name} checkpoint shape {tuple(t.shape)}, model {tuple(own[name].shape)}"
                )
            own[name].copy_(t.to(own[name].device, own[name].dtype))


def import_hf(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """Build our model from an HF checkpoint directory (config.json + *.safetensors)."""
    path = Path(path)
    cfg = read_hf_config(path)
    tensors = _read_tensors(path)
    model = build_model(cfg, device=device, dtype=dtype)
    _copy_into(model, hf_to_megatron(tensors, cfg), cfg, path)
    return model


def check_matches(model_cfg: ModelConfig, path: str | Path) -> None:
    """InvalidArgument naming every architecture field where `model_cfg` differs from checkpoint `path`."""
    want = read_hf_config(path).model_dump(exclude=_NOT_IN_CHECKPOINT)
    have = model_cfg.model_dump(exclude=_NOT_IN_CHECKPOINT)
    diff = {k: (have[k], want[k]) for k in want if have[k] != want[k]}
    if diff:
        fields = ", ".join(f"{k}: config {a!r} vs checkpoint {b!r}" for k, (a, b) in diff.items())
        raise InvalidArgument(
            f"the model section does not match the HF checkpoint {path} ({fields}); print the matching "
            f"section with `python -m services.trainer.hf model-config {path}`"
        )


def load_initial_weights(model: Any, path: str | Path) -> None:
    """Load version-0 weights into `model` in place: an HF checkpoint directory or a Gyre safetensors file.

    A directory must hold an HF Llama/Qwen2/Qwen3 checkpoint whose architecture equals the model's
    (`check_matches`); a file is a safetensors file in Gyre's (Megatron) names (`load_weights`).
    Raises InvalidArgument, never loads a partial or mismatched state.
    """
    from gyre.model import load_weights, model_config_of

    path = Path(path)
    if path.is_dir():
        cfg = model_config_of(model)
        check_matches(cfg, path)
        _copy_into(model, hf_to_megatron(_read_tensors(path), cfg), cfg, path)
    elif path.is_file():
        load_weights(model, path)
    else:
        raise InvalidArgument(
            f"initial weights {path} do not exist (an HF checkpoint directory or a .safetensors file)"
        )


def export_hf(model: Any, path: str | Path) -> Path:
    """Write `model` as an HF checkpoint directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    from gyre.model import model_config_of

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model_config_of(model)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    hf = megatron_to_hf(state, cfg)
    save_file(
        {k: v.contiguous().clone() for k, v in hf.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (path / "config.json").write_text(json.dumps(hf_config_from_model(cfg), indent=2))
    return path
