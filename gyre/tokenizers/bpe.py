"""The project's own small Hugging Face tokenizer: a byte-level BPE trained with `tokenizers` on
the corpus shipped in gyre/tokenizers/data/corpus.txt, with Gyre's Qwen-style chat template
(data/chat_template.jinja, tools included), written to a directory that `AutoTokenizer` loads.
No hub access; the same corpus and settings give the same tokenizer.

Specials (ChatML): `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos: ends an assistant
turn). Tool and reasoning markers (`<tool_call>`, `</tool_call>`, `<tool_response>`,
`</tool_response>`, `<think>`, `</think>`) are added tokens that decoding keeps, as in Qwen's.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent / "data"
CORPUS = DATA / "corpus.txt"
CHAT_TEMPLATE = DATA / "chat_template.jinja"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKER_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def write_tiny_tokenizer(out: str | Path, *, vocab_size: int = 1024) -> int:
    """Train the BPE on CORPUS and the template's own text, save it into `out`; returns its vocabulary size.

    `vocab_size` is the trainer's upper bound (bytes + merges + added tokens); a small corpus
    stops earlier. Also writes generation_config.json naming the stop ids (`<|im_end|>`,
    `<|endoftext|>`).
    """
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    template = CHAT_TEMPLATE.read_text()
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([CORPUS.read_text(), template], trainer=trainer)
    bpe.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = template
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    write_generation_config(out)
    return len(fast)


def write_generation_config(out: str | Path) -> None:
    """generation_config.json in `out` naming the stop ids of the tokenizer saved there.

    Write it after the model: `save_pretrained` of a model replaces the file with its own.
    """
    ids = [_token_id(Path(out), t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = {"eos_token_id": ids, "pad_token_id": ids[1]}
    (Path(out) / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _token_id(out: Path, token: str) -> int:
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    return next(int(t["id"]) for t in added if t["content"] == token)
