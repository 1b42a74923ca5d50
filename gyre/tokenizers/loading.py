"""Loading a tokenizer by its spec (`byte` or a Hugging Face directory), and the config-time
vocabulary check every service runs on the spec it is given.

Kept apart from `base.py` so that the interface never imports its implementations (byte.py and
hf.py import the interface; this module imports all three).
"""

from __future__ import annotations

import functools
from pathlib import Path

from gyre.errors import ConfigError

from .base import BYTE_SPEC, Tokenizer, check_vocabulary


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by `spec` (`byte` or a Hugging Face tokenizer directory); cached per spec."""
    if spec == BYTE_SPEC:
        from .byte import ByteTokenizer

        return ByteTokenizer()
    path = Path(spec)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ConfigError(
            f"tokenizer {spec!r}: not 'byte' and not a directory with tokenizer.json / tokenizer_config.json"
        )
    from .hf import HFTokenizer

    return HFTokenizer(path)


TOKENIZER_FIELD_DESCRIPTION = (
    "Tokenizer of the run: 'byte' (Gyre's byte tokenizer, vocabulary 512) or the path of a Hugging Face "
    "tokenizer directory (tokenizer.json + tokenizer_config.json with a chat template; usually the "
    "checkpoint directory). Every service of a run names the same one; a model whose vocab_size cannot "
    "hold its ids is refused at startup."
)


def vocabulary_problem(spec: str, vocab_size: int, where: str) -> str | None:
    """Why `spec`'s tokenizer does not fit a model of `vocab_size` (None: it fits); for config validators."""
    try:
        check_vocabulary(load_tokenizer(spec), vocab_size, where)
    except ConfigError as exc:
        return str(exc)
    return None
