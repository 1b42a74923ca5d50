"""The benchmarks measure what they claim: the trainer's flat baseline trains the same loss as the
tree, and the rollout bench's migrations are token-exact while sampling (temperature 1, seeded).

No timing is asserted here (speed is what the benches print); these tests check that the thing
each bench times is the right thing.
"""

from __future__ import annotations

import argparse
import asyncio

import pytest


def test_the_flat_micro_batches_hold_every_path_and_train_the_same_loss_as_the_tree() -> None:
    import torch

    from gyre.model import ModelConfig, build_model
    from services.trainer.bench import branching_batch, flat_micro_batches
    from services.trainer.loss import LossSettings, tree_loss

    torch.manual_seed(0)
    tree = branching_batch(prefix_len=24, num_branches=3, branch_len=8, depth=2, seed=0)
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=2, ffn_hidden_size=128)
    model = build_model(cfg, seed=0)
    settings = LossSettings(clip_eps=0.2)
    tree_value = tree_loss(model, tree, settings)[0].item()
    num_paths = len(tree.path_weights)
    path_tokens = sum(24 + 8 + 8 for _ in range(num_paths))  # prompt + branch + sub-branch
    for k in (1, 2, num_paths):
        micro = flat_micro_batches(tree, k)
        assert len(micro) == -(-num_paths // k)
        assert sum(mb.num_tokens for mb in micro) == path_tokens
        flat_value = sum(tree_loss(model, mb, settings)[0].item() for mb in micro)
        assert flat_value == pytest.approx(tree_value, rel=1e-4, abs=1e-6)


def test_migrated_generations_are_token_exact_while_sampling_at_temperature_one() -> None:
    from services.rollout.bench import run_bench

    args = argparse.Namespace(
        devices=3,
        tasks=2,
        group_size=2,
        reassignments=4,
        max_tokens=8,
        max_turns=6,
        gap_s=0.01,
        seed=3,
        temperature=1.0,
        repeats=1,
    )
    result = asyncio.run(run_bench(args))
    assert result["temperature"] == 1.0
    assert result["reassignments"] >= 4 and result["migrated_completions"] > 0
    assert result["executions_interrupted"] == 0
    assert result["token_exact"] is True
