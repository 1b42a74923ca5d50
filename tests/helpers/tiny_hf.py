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
