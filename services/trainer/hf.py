"""Hugging Face checkpoints in and out of a Gyre run (the mapping itself is `gyre.model.hf`).

    python -m services.trainer.hf model-config CKPT_DIR
        print the `model:` section (YAML) that matches an HF Llama/Qwen2/Qwen3 checkpoint; put it under
        both `trainer.model` and `rollout.model` and set `trainer.init_weights` and
        `rollout.init_weights` to CKPT_DIR (examples/hf_model.yaml)
    python -m services.trainer.hf tiny OUT_DIR
        write a tiny random Llama checkpoint (vocab 512 = Gyre's byte tokenizer, 2 layers, hidden 64)
        with `transformers`, no download
    python -m services.trainer.hf tiny-qwen2 OUT_DIR
        write a tiny random Qwen2 checkpoint *and its own tokenizer* (a BPE the project trains on its
        shipped corpus, Qwen-style chat template with tools: gyre/tokenizers/bpe.py), no download:
        what examples/hf_model.yaml expects
    python -m services.trainer.hf tiny-qwen3 OUT_DIR
        the same for a tiny Qwen3 (per-head q/k norms, head_dim 32 with heads * head_dim != hidden)
    python -m services.trainer.hf tiny-llama31-rope OUT_DIR
        the same for a tiny Llama with Llama-3.1 RoPE scaling (rope_type "llama3")
    python -m services.trainer.hf export --weights RUN_DIR/weights/v000002.safetensors \\
            --like CKPT_DIR --out OUT_DIR
        write a trained weight version as an HF checkpoint directory (config.json +
        model.safetensors) that `transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` and
        `vllm serve OUT_DIR` load

The mapping lives in the runtime (`gyre.model.hf`) because the rollout torch engine loads the same
checkpoint as version 0; this module keeps the trainer-side names and the command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml

from gyre.model.config import ModelConfig
from gyre.model.hf import (
    check_matches,
    export_hf,
    hf_config_from_model,
    hf_to_megatron,
    import_hf,
    load_initial_weights,
    megatron_to_hf,
    model_config_from_hf,
    read_hf_config,
)

__all__ = [
    "check_matches",
    "export_hf",
    "export_weights",
    "hf_config_from_model",
    "hf_to_megatron",
    "import_hf",
    "load_initial_weights",
    "megatron_to_hf",
    "model_config_from_hf",
    "read_hf_config",
    "write_tiny_llama",
    "write_tiny_llama31_rope",
    "write_tiny_qwen2",
    "write_tiny_qwen3",
]


def export_weights(weights: str | Path, model_cfg: ModelConfig, out: str | Path) -> Path:
    """Write a Gyre weight version (safetensors in Megatron names) as an HF checkpoint directory."""
    from gyre.model import build_model, load_weights

    model = build_model(model_cfg, device="cpu", dtype=torch.float32)
    load_weights(model, weights)
    return export_hf(model, out)


def write_tiny_llama(out: str | Path, seed: int = 0) -> Path:
    """A tiny random Llama checkpoint written by `transformers` (the shape of examples/hf_model.yaml)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return Path(out)


def write_tiny_qwen2(out: str | Path, seed: int = 0) -> Path:
    """A tiny random Qwen2 checkpoint with the project's own BPE tokenizer and chat template in `out`.

    The embedding has the tokenizer's size rounded up to a multiple of 64 rows (as checkpoints pad
    theirs); 2 layers, hidden 64, 1024 positions. `AutoTokenizer` and `AutoModelForCausalLM` load
    the directory offline.
    """
    return _write_tiny(out, seed, "Qwen2")


def _write_tiny(
    out: str | Path, seed: int, family: str, *, norms_away: bool = False, **extra: object
) -> Path:
    """The project's BPE tokenizer and a seeded tiny `<family>ForCausalLM` in `out`: embedding rows
    the tokenizer's size rounded up to 64, 2 layers, hidden 64, 4 heads (2 KV), 1024 positions,
    plus `extra` config fields; `norms_away`: norm weights drawn in [0.5, 1.5]."""
    import transformers

    from gyre.tokenizers.bpe import write_generation_config, write_tiny_tokenizer

    num_ids = write_tiny_tokenizer(out)
    torch.manual_seed(seed)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=-(-num_ids // 64) * 64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **extra,
    )
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    if norms_away:
        _norms_away_from_one(model)
    model.save_pretrained(out)
    write_generation_config(out)  # the model's save replaced it
    return Path(out)


def _norms_away_from_one(model: torch.nn.Module) -> None:
    with torch.no_grad():  # so a swapped or missing norm (q_norm / k_norm included) would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def write_tiny_qwen3(out: str | Path, seed: int = 0) -> Path:
    """A tiny random Qwen3 checkpoint (per-head q/k norms) with the project's BPE tokenizer in `out`.

    As write_tiny_qwen2, plus head_dim 32 with 4 heads (heads * head_dim = 128 != hidden 64, as in
    real Qwen3 checkpoints) and norms drawn away from 1. Loads offline with `AutoTokenizer` and
    `AutoModelForCausalLM`.
    """
    return _write_tiny(out, seed, "Qwen3", norms_away=True, head_dim=32)


def write_tiny_llama31_rope(out: str | Path, seed: int = 0) -> Path:
    """A tiny random Llama with Llama-3.1 RoPE scaling ("llama3") and the project's BPE tokenizer in `out`.

    head_dim 16, theta 10000, original_max_position_embeddings 64 (low/high freq factors 1 and 4,
    factor 8): its 8 rotary frequencies fall in all three bands (kept, interpolated, scaled), and
    the 1024 positions reach far beyond the original context.
    """
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return _write_tiny(out, seed, "Llama", norms_away=True, rope_parameters=rope)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.trainer.hf", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cfg_cmd = sub.add_parser("model-config", help="print the model section matching an HF checkpoint")
    cfg_cmd.add_argument("checkpoint", type=Path)
    tiny = sub.add_parser("tiny", help="write a tiny random Llama checkpoint (no download)")
    tiny.add_argument("out", type=Path)
    tiny_qwen2 = sub.add_parser("tiny-qwen2", help="write a tiny random Qwen2 checkpoint and its tokenizer")
    tiny_qwen2.add_argument("out", type=Path)
    tiny_qwen3 = sub.add_parser("tiny-qwen3", help="write a tiny random Qwen3 checkpoint and its tokenizer")
    tiny_qwen3.add_argument("out", type=Path)
    tiny_rope = sub.add_parser(
        "tiny-llama31-rope", help="write a tiny random Llama-3.1-RoPE-scaled checkpoint and its tokenizer"
    )
    tiny_rope.add_argument("out", type=Path)
    exp = sub.add_parser("export", help="write a trained weight version as an HF checkpoint")
    exp.add_argument("--weights", type=Path, required=True, help="RUN_DIR/weights/vNNNNNN.safetensors")
    exp.add_argument("--like", type=Path, required=True, help="the HF checkpoint the run started from")
    exp.add_argument("--out", type=Path, required=True, help="output directory")
    args = parser.parse_args(argv)

    from gyre.errors import GyreError

    try:
        if args.command == "model-config":
            cfg = read_hf_config(args.checkpoint)
            print(yaml.safe_dump({"model": cfg.model_dump(exclude={"init_std", "attention_backend"})}))
        elif args.command == "tiny":
            print(f"wrote {write_tiny_llama(args.out)}")
        elif args.command == "tiny-qwen2":
            print(f"wrote {write_tiny_qwen2(args.out)}")
        elif args.command == "tiny-qwen3":
            print(f"wrote {write_tiny_qwen3(args.out)}")
        elif args.command == "tiny-llama31-rope":
            print(f"wrote {write_tiny_llama31_rope(args.out)}")
        else:
            out = export_weights(args.weights, read_hf_config(args.like), args.out)
            print(f"wrote {out}")
    except GyreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
