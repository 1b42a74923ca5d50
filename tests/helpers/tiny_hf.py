"""The project's tiny Qwen2 checkpoint and tokenizer (services.trainer.hf.write_tiny_qwen2), written
once per test session into a temporary directory; no hub access."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path


@functools.lru_cache(maxsize=1)
def tiny_qwen2_dir() -> Path:
    from services.trainer.hf import write_tiny_qwen2

    out = Path(tempfile.mkdtemp(prefix="gyre-tiny-qwen2-")) / "ckpt"
    return write_tiny_qwen2(out)


def fine_tune(
    ckpt: Path, out: Path, examples: list[tuple[list[int], list[int]]], *, steps: int = 300
) -> Path:
    """A copy of `ckpt` in `out` trained (AdamW, full batch) to answer each (prompt ids -> completion
    ids) example greedily: the loss is on the completion tokens only. For tests that need a real
    model to emit a given tool call; the checkpoint's tokenizer files are copied beside it."""
    import shutil

    import torch
    import transformers

    from gyre.tokenizers.bpe import write_generation_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(ckpt), local_files_only=True, dtype=torch.float32
    )
    width = max(len(p) + len(c) for p, c in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    for row, (prompt, completion) in enumerate(examples):
        seq = [*prompt, *completion]
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(prompt) : len(seq)] = torch.tensor(completion)
        mask[row, : len(seq)] = 1
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (ckpt / name).exists():
            shutil.copy(ckpt / name, out / name)
    write_generation_config(out)
    return out
