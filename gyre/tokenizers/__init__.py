"""Tokenizers a run can use, behind one interface (`Tokenizer`): Gyre's byte tokenizer and a
Hugging Face one loaded from a checkpoint directory. `load_tokenizer(spec)` picks by spec
("byte", or a directory path); `check_vocabulary` is the one startup check that a model can embed
every id the tokenizer produces.
"""

from .base import Tokenizer, VocabularyMismatch, check_vocabulary
from .loading import TOKENIZER_FIELD_DESCRIPTION, load_tokenizer, vocabulary_problem

__all__ = [
    "TOKENIZER_FIELD_DESCRIPTION",
    "Tokenizer",
    "VocabularyMismatch",
    "check_vocabulary",
    "load_tokenizer",
    "vocabulary_problem",
]
