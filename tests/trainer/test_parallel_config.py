"""The trainer's tensor/context parallel sizes are checked against the model when the config loads,
and sizes above 1 are refused, with the reason, outside what the model-parallel replicas support
(CPU/gloo)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gyre.model.config import ModelConfig, tensor_parallel_problem
from services.trainer.config import TrainerConfig


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused_naming_them():
    with pytest.raises(ValidationError, match="tensor_parallel_size.*num_attention_heads 4"):
        TrainerConfig(tensor_parallel_size=3)


def test_context_parallel_above_one_is_accepted_on_cpu_and_refused_elsewhere():
    for sizes in ({"context_parallel_size": 2}, {"context_parallel_size": 2, "tensor_parallel_size": 2}):
        assert TrainerConfig(device="cpu", **sizes).context_parallel_size == 2
        with pytest.raises(ValidationError, match="CPU/gloo only"):
            TrainerConfig(device="cuda", **sizes)
    assert TrainerConfig().tensor_parallel_size == TrainerConfig().context_parallel_size == 1


def test_tensor_parallel_is_accepted_with_bf16_masters_and_zero1_on_cpu_only():
    for other in ({}, {"precision": "bf16"}, {"optimizer_sharding": "zero1"}):
        assert (
            TrainerConfig(**{"tensor_parallel_size": 2, "device": "cpu", **other}).tensor_parallel_size == 2
        )
    with pytest.raises(ValidationError, match="CPU/gloo only"):
        TrainerConfig(tensor_parallel_size=2, device="cuda")


def test_tensor_parallel_problem_names_only_the_sizes_that_do_not_split():
    cfg = ModelConfig(num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256, vocab_size=512)
    assert tensor_parallel_problem(cfg, 2) is None
    problem = tensor_parallel_problem(cfg, 4)
    assert problem is not None and "num_query_groups) 2" in problem and "vocab_size" not in problem
