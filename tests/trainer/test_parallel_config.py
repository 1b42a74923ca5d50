"""The trainer's tensor/context parallel sizes are checked against the model when the config loads,
and sizes above 1 are refused with the reason (they are model-level only, not wired into `gyre run`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gyre.model.config import ModelConfig, tensor_parallel_problem
from services.trainer.config import TrainerConfig


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused_naming_them():
    with pytest.raises(ValidationError, match="tensor_parallel_size.*num_attention_heads 4"):
        TrainerConfig(tensor_parallel_size=3)


def test_tensor_or_context_parallel_above_one_is_refused_until_gyre_run_starts_those_ranks():
    for sizes in ({"tensor_parallel_size": 2}, {"context_parallel_size": 2}):
        with pytest.raises(ValidationError, match="step loop still trains single-process replicas"):
            TrainerConfig(**sizes)
    assert TrainerConfig().tensor_parallel_size == TrainerConfig().context_parallel_size == 1


def test_tensor_parallel_problem_names_only_the_sizes_that_do_not_split():
    cfg = ModelConfig(num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256, vocab_size=512)
    assert tensor_parallel_problem(cfg, 2) is None
    problem = tensor_parallel_problem(cfg, 4)
    assert problem is not None and "num_query_groups) 2" in problem and "vocab_size" not in problem
