"""HF interop: a tiny random Llama / Qwen2 built locally (no download) imports with equal logits, and exports back exactly."""

from __future__ import annotations

import pytest
import torch

from gyre.model import causal_logits
from services.trainer.hf import export_hf, import_hf


def _tiny(kind: str, tie: bool):
    import transformers

    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_theta=5000.0))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():  # non-trivial norms, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize("kind,tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_imported_hf_model_gives_the_same_logits_and_exports_back_exactly(tmp_path, kind, tie):
    import transformers

    hf = _tiny(kind, tie)
    hf.save_pretrained(tmp_path / "hf")
    ours = import_hf(tmp_path / "hf")
    ids = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        expected = hf(ids).logits
        got = causal_logits(ours, ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    export_hf(ours, tmp_path / "out")
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM
    back = cls.from_pretrained(tmp_path / "out")
    original = hf.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name
