"""gpu_check's model-parallel section (services/trainer/parallel_check.py) on gloo: two CPU ranks give
TP=2 and CP=2 the TP=1 loss and gradients, it stops itself at its time limit, and it skips NCCL
without two GPUs. NCCL itself is not exercised here (no GPU)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from gyre.model import ModelConfig
from gyre.model.trees import random_tree
from services.trainer.batch import PackedBatch
from services.trainer.parallel_check import check_model_parallel
from tests.trainer.helpers import batch_from_tree


def _batch() -> PackedBatch:
    rng = random.Random(3)
    batch = batch_from_tree(random_tree(rng, 12, max_len=5, num_roots=2), rng)
    assert isinstance(batch, PackedBatch)
    return batch


@pytest.mark.slow  # two spawned ranks importing torch + Megatron: ~20-40 s here under the shared load
def test_two_gloo_ranks_match_tp1_in_fp32_and_stay_near_bf16s_floor() -> None:
    report = check_model_parallel(ModelConfig(), _batch(), backend="gloo", steps=1, time_limit_s=300)
    assert "error" not in report, report.get("error")
    print({k: report[k] for k in ("tp1", "tp2", "cp2")})
    assert report["within_tolerance"] and report["backend"] == "gloo"
    for label in ("tp2", "cp2"):
        fp32, bf16 = report[label]["float32"], report[label]["bfloat16"]
        assert fp32["loss_gap"] < 1e-5 and fp32["grad_gap"] < 1e-5  # float32 summation order only
        assert bf16["grad_gap_fp32"] < 3 * report["tp1"]["bfloat16"]["grad_gap_fp32"]
        assert fp32["step_s"] > 0 and bf16["step_s"] > 0
    assert report["cp2"]["float32"]["tokens_on_rank"] < report["num_tokens"]  # CP split the tokens
    assert report["tp2"]["float32"]["tokens_on_rank"] == report["num_tokens"]


def test_it_reports_a_timeout_and_kills_its_ranks_instead_of_hanging() -> None:
    t0 = time.monotonic()
    report = check_model_parallel(ModelConfig(), _batch(), backend="gloo", steps=1, time_limit_s=1)
    assert report["error"].startswith("timed out after 1 s")
    assert time.monotonic() - t0 < 30


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="needs fewer than 2 GPUs")
def test_nccl_without_two_gpus_is_skipped_not_failed() -> None:
    report = check_model_parallel(ModelConfig(), _batch(), backend="nccl", steps=1, time_limit_s=60)
    assert report == {"skipped": f"{torch.cuda.device_count()} GPU(s); needs 2"}
