"""HF interop for Qwen3 (per-head q/k norms, heads * head_dim != hidden) and Llama-3.1 RoPE scaling:
tiny checkpoints written locally by services.trainer.hf (no download) import with transformers' logits,
train two AdamW steps, export, and load back into transformers with the trained model's logits;
rope types Gyre cannot compute are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gyre.errors import InvalidArgument
from gyre.model import ModelConfig, causal_logits
from gyre.model.hf import export_hf, hf_config_from_model, import_hf, model_config_from_hf

WRITERS = {"qwen3": "write_tiny_qwen3", "llama31-rope": "write_tiny_llama31_rope"}


def _write(kind: str, out: Path) -> Path:
    import services.trainer.hf as trainer_hf

    return getattr(trainer_hf, WRITERS[kind])(out)


def _ids(vocab: int, batch: int = 2, length: int = 300, seed: int = 0) -> torch.Tensor:
    # 300 positions: past the llama31 checkpoint's original_max_position_embeddings (64) several times
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.slow
def test_tiny_qwen3_imports_with_transformers_logits_and_exports_back_exactly(tmp_path):
    import transformers

    ckpt = _write("qwen3", tmp_path / "qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    assert isinstance(hf, transformers.Qwen3ForCausalLM)
    ours = import_hf(ckpt)
    cfg = ours.gyre_config
    assert cfg.qk_layernorm and cfg.kv_channels == 32 and cfg.head_dim * cfg.num_attention_heads != 64
    ids = _ids(cfg.vocab_size)
    with torch.no_grad():
        expected, got = hf(ids).logits, causal_logits(ours, ids)
    gap = _gap(got, expected)
    print(f"qwen3 import: max |gyre logits - transformers logits| = {gap:.2e}")
    assert gap < 1e-4

    out = export_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(back, transformers.Qwen3ForCausalLM)
    assert back.config.head_dim == 32 and not back.config.attention_bias
    original = hf.state_dict()
    assert set(back.state_dict()) == set(original)
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name


@pytest.mark.slow
def test_tiny_llama31_rope_imports_with_transformers_logits_and_the_scaling_matters(tmp_path):
    import transformers

    ckpt = _write("llama31-rope", tmp_path / "llama31")
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    ours = import_hf(ckpt)
    cfg = ours.gyre_config
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_position_embeddings) == (
        "llama3",
        8.0,
        64,
    )
    ids = _ids(cfg.vocab_size)
    with torch.no_grad():
        expected, got = hf(ids).logits, causal_logits(ours, ids)
    gap = _gap(got, expected)
    print(f"llama3 rope import: max |gyre logits - transformers logits| = {gap:.2e}")
    assert gap < 1e-4

    # the same weights without the scaling are measurably off: the test would see a wrong formula
    from gyre.model import build_model
    from gyre.model.hf import load_initial_weights

    plain = build_model(cfg.model_copy(update={"rope_scaling": "none"}))
    with pytest.raises(InvalidArgument, match="rope_scaling: config 'none' vs checkpoint 'llama3'"):
        load_initial_weights(plain, ckpt)
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        unscaled = _gap(causal_logits(plain, ids), expected)
    print(f"llama3 rope import without the scaling: max gap = {unscaled:.2e}")
    assert unscaled > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_import_train_two_steps_export_loads_into_transformers_with_the_trained_logits(tmp_path, kind):
    import transformers

    ckpt = _write(kind, tmp_path / kind)
    untrained = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    model = import_hf(ckpt)
    vocab = model.gyre_config.vocab_size
    batch = _ids(vocab, batch=4, length=96, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        logits = causal_logits(model, batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()

    out = export_hf(model, tmp_path / "trained")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(untrained)
    assert back.config.rope_parameters == untrained.config.rope_parameters
    ids = _ids(vocab)
    with torch.no_grad():
        mine, theirs, before = causal_logits(model, ids), back(ids).logits, untrained(ids).logits
    gap, moved = _gap(mine, theirs), _gap(theirs, before)
    print(
        f"{kind} trained 2 steps (loss {losses[0]:.4f} -> {losses[1]:.4f}), exported: "
        f"max |gyre - transformers| = {gap:.2e}; max |trained - untrained| = {moved:.2e}"
    )
    assert gap < 1e-4
    assert moved > 1e-2
    if kind == "qwen3":  # the q/k norms trained and exported too
        name = "model.layers.0.self_attn.q_norm.weight"
        assert not torch.equal(back.state_dict()[name], untrained.state_dict()[name])


def _hf_llama(**extra):
    return {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        **extra,
    }


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn", "longrope", "su"])
@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_types_are_refused_by_name(rope_type, key):
    with pytest.raises(InvalidArgument, match=f"rope type '{rope_type}' is not supported"):
        model_config_from_hf(_hf_llama(**{key: {"rope_type": rope_type, "factor": 2.0}}))
    with pytest.raises(InvalidArgument, match=f"rope type '{rope_type}'"):
        model_config_from_hf(_hf_llama(**{key: {"type": rope_type, "factor": 2.0}}))  # the old spelling


def test_llama3_rope_parameters_map_both_ways_and_odd_ones_are_refused():
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = model_config_from_hf(_hf_llama(rope_scaling=rope))  # Llama 3.1's own config.json spelling
    assert (cfg.rope_scaling, cfg.rotary_base, cfg.rope_original_max_position_embeddings) == (
        "llama3",
        500000.0,
        8192,
    )
    assert hf_config_from_model(cfg)["rope_parameters"] == rope
    with pytest.raises(InvalidArgument, match="needs 'low_freq_factor'"):
        model_config_from_hf(
            _hf_llama(rope_parameters={k: v for k, v in rope.items() if k != "low_freq_factor"})
        )
    with pytest.raises(InvalidArgument, match=r"parameters \['mscale'\] are not supported"):
        model_config_from_hf(_hf_llama(rope_parameters={**rope, "mscale": 1.0}))
    with pytest.raises(InvalidArgument, match="high_freq_factor must exceed"):
        model_config_from_hf(_hf_llama(rope_parameters={**rope, "high_freq_factor": 1.0}))
    with pytest.raises(InvalidArgument, match="partial_rotary_factor"):
        model_config_from_hf(_hf_llama(partial_rotary_factor=0.5))


def test_qwen3_config_maps_to_qk_layernorm_and_kv_channels_and_back():
    hf = {**_hf_llama(), "model_type": "qwen3", "head_dim": 16, "layer_types": ["full_attention"]}
    cfg = model_config_from_hf(hf)
    assert cfg.qk_layernorm and not cfg.add_qkv_bias and cfg.kv_channels == 16 and cfg.head_dim == 16
    back = hf_config_from_model(cfg)
    assert (back["model_type"], back["head_dim"], back["attention_bias"]) == ("qwen3", 16, False)
    assert model_config_from_hf(back) == cfg
    assert model_config_from_hf({**hf, "head_dim": 8}).kv_channels is None  # 4 * 8 = hidden 32
    with pytest.raises(InvalidArgument, match="attention_bias"):
        model_config_from_hf({**hf, "attention_bias": True})
    with pytest.raises(InvalidArgument, match="sliding-window"):
        model_config_from_hf({**hf, "use_sliding_window": True})
    with pytest.raises(InvalidArgument, match="sliding-window"):
        model_config_from_hf({**hf, "layer_types": ["sliding_attention"]})
    with pytest.raises(InvalidArgument, match="no HF model type"):
        hf_config_from_model(cfg.model_copy(update={"add_qkv_bias": True}))
    with pytest.raises(ValueError, match="even head dimension"):
        ModelConfig(hidden_size=30, num_attention_heads=4, kv_channels=7)
