"""A tree larger than the micro-batch budget is split along its nodes, later parts carrying their
ancestors as recomputed untrained context, and the parts' summed loss and gradients equal the whole
tree's (float64)."""

from __future__ import annotations

import random

import pytest
import torch

from gyre.model import ModelConfig, build_model
from gyre.model.trees import random_tree, shared_prefix_tree
from services.trainer.batch import PackedBatch
from services.trainer.loss import LossSettings, batch_logprobs, tree_loss
from services.trainer.split_trees import split_tree
from services.trainer.step import train_batch
from tests.trainer.helpers import batch_from_tree


def _batch(tree, seed: int) -> PackedBatch:
    out = batch_from_tree(tree, random.Random(seed))
    assert isinstance(out, PackedBatch)
    return out.to("cpu", torch.float64)


def test_a_wide_tree_is_split_into_parts_within_the_budget_that_train_every_node_once():
    # prompt 10, 4 branches of 6, each branching twice more into 6: paths of 22 tokens, 82 in all.
    tree = shared_prefix_tree(10, 4, 6, depth=2)
    parts = split_tree(tree.node_lengths, tree.node_parents, 0, len(tree.node_lengths), 30)
    assert len(parts) > 1
    trained = sorted(n for p in parts for n in p.trained or ())
    assert trained == list(range(len(tree.node_lengths)))  # every node once
    for part in parts:
        assert part.num_tokens <= 30
        assert part.num_tokens == sum(tree.node_lengths[n] for n in part.nodes)
        for n in part.nodes:  # ancestors included
            assert tree.node_parents[n] == -1 or tree.node_parents[n] in part.nodes
    assert any(0 not in (p.trained or ()) and 0 in p.nodes for p in parts)  # the prompt is context


def test_a_chain_longer_than_the_budget_stays_whole_and_small_trees_are_not_split():
    chain = split_tree([40, 30], [-1, 0], 0, 2, 16)
    assert len(chain) == 1 and chain[0].trained is None and chain[0].num_tokens == 70
    small = split_tree([4, 3, 3], [-1, 0, 0], 0, 3, 16)
    assert len(small) == 1 and small[0].trained is None


def test_a_tree_whose_parts_would_recompute_more_than_the_bound_stays_whole():
    # a 3,000-token prompt with ten 100-token answers, budget 2,048: ten parts of 3,100 tokens
    lengths, parents = [3000] + [100] * 10, [-1] + [0] * 10
    parts = split_tree(lengths, parents, 0, 11, 2048)
    assert len(parts) == 1 and parts[0].trained is None
    forced = split_tree(lengths, parents, 0, 11, 2048, max_recompute=100.0)
    assert len(forced) == 10 and all(p.num_tokens == 3100 for p in forced)


def test_a_part_of_nodes_not_in_depth_first_order_brings_every_ancestor_it_needs():
    # node 3's parent is 1 while node 2 (a child of 0) lies between them.
    lengths, parents = [4, 4, 4, 4], [-1, 0, 0, 1]
    parts = split_tree(lengths, parents, 0, 4, 12)
    last = parts[-1]
    assert 3 in (last.trained or ()) and {0, 1} <= set(last.nodes)


@pytest.mark.parametrize("seed,budget", [(0, 14), (1, 20), (2, 9)])
def test_split_tree_parts_sum_to_the_whole_tree_loss_and_gradients(seed, budget):
    cfg = ModelConfig(num_query_groups=2, attention_backend="dense")
    model = build_model(cfg, dtype=torch.float64, seed=seed)
    ref = build_model(cfg, dtype=torch.float64, seed=seed + 50).requires_grad_(False)
    rng = random.Random(seed)
    batch = _batch(random_tree(rng, 12, max_len=5, num_roots=2), seed)
    with torch.no_grad():
        lp = batch_logprobs(model, batch)
    noise = torch.tensor([rng.uniform(-0.4, 0.4) for _ in range(batch.num_tokens)], dtype=torch.float64)
    batch.behaviour_logprobs = torch.where(batch.loss_mask, lp + noise, torch.zeros_like(lp))
    settings = LossSettings(kl_coef=0.05, entropy_coef=0.1, chunk_tokens=5)
    params = list(model.parameters())

    whole, _ = tree_loss(model, batch, settings, ref)
    whole_grads = torch.autograd.grad(whole, params)
    micros = batch.micro_batches(budget)
    split_total = torch.zeros((), dtype=torch.float64)
    split_grads = [torch.zeros_like(p) for p in params]
    for micro in micros:
        loss, _ = tree_loss(model, micro, settings, ref)
        split_total = split_total + loss.detach()
        for acc, g in zip(split_grads, torch.autograd.grad(loss, params), strict=True):
            acc += g

    recomputed = sum(m.num_tokens for m in micros) - batch.num_tokens
    assert recomputed > 0  # some tree really was split and its context recomputed
    assert sum(int(m.loss_mask.sum()) for m in micros) == int(batch.loss_mask.sum())
    torch.testing.assert_close(split_total, whole.detach(), rtol=1e-9, atol=1e-12)
    for g_split, g_whole in zip(split_grads, whole_grads, strict=True):
        torch.testing.assert_close(g_split, g_whole, rtol=1e-8, atol=1e-12)


def test_a_training_step_with_a_budget_below_the_tree_size_takes_the_step_of_the_whole_tree():
    cfg = ModelConfig(num_query_groups=2)
    model = build_model(cfg, dtype=torch.float64, seed=3)
    twin = build_model(cfg, dtype=torch.float64, seed=3)  # same weights (deepcopy can't copy process groups)
    batch = _batch(shared_prefix_tree(12, 4, 5, depth=2), 3)
    settings = LossSettings(entropy_coef=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)

    whole = train_batch(model, opt, batch, settings, None, grad_clip=1.0, micro_batch_tokens=10_000)
    split = train_batch(twin, twin_opt, batch, settings, None, grad_clip=1.0, micro_batch_tokens=40)

    assert whole["num_tokens"] == batch.num_tokens < split["num_tokens"]  # context recomputed
    assert split["num_trained_tokens"] == whole["num_trained_tokens"]
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-9)
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-9)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


def stripped_reasoning_tree(prompt: int, turns: int, reasoning: int, answer: int, observation: int):
    """An execution whose history drops each turn's reasoning: every call's prompt is the prompt plus
    the earlier answers and observations, so each turn branches twice from the history so far: the
    call's reasoning + answer (a leaf), and the answer + observation that the next prompt keeps."""
    from gyre.model.trees import TreeArrays

    offsets, lengths, parents, positions = [0], [prompt], [-1], list(range(prompt))
    history, start = 0, prompt
    for _ in range(turns):
        for size in (reasoning + answer, answer + observation):
            offsets.append(sum(lengths))
            lengths.append(size)
            parents.append(history)
            positions.extend(range(start, start + size))
        history, start = len(lengths) - 1, start + answer + observation
    return TreeArrays(offsets, lengths, parents, positions)


def test_a_stripped_reasoning_tree_split_into_four_or_more_parts_has_the_whole_trees_loss_and_gradients():
    tree = stripped_reasoning_tree(8, 10, 8, 2, 2)  # 148 tokens, longest path 54
    budget = 64
    cfg = ModelConfig(num_query_groups=2, attention_backend="dense")
    model = build_model(cfg, dtype=torch.float64, seed=7)
    ref = build_model(cfg, dtype=torch.float64, seed=57).requires_grad_(False)
    batch = _batch(tree, 7)
    settings = LossSettings(kl_coef=0.05, entropy_coef=0.1, chunk_tokens=16)
    params = list(model.parameters())

    whole, _ = tree_loss(model, batch, settings, ref)
    whole_grads = torch.autograd.grad(whole, params)
    micros = batch.micro_batches(budget)
    assert len(micros) >= 4 and all(m.num_tokens <= budget for m in micros)
    split_total = torch.zeros((), dtype=torch.float64)
    split_grads = [torch.zeros_like(p) for p in params]
    for micro in micros:
        loss, _ = tree_loss(model, micro, settings, ref)
        split_total = split_total + loss.detach()
        for acc, g in zip(split_grads, torch.autograd.grad(loss, params), strict=True):
            acc += g
    assert sum(int(m.loss_mask.sum()) for m in micros) == int(batch.loss_mask.sum())
    torch.testing.assert_close(split_total, whole.detach(), rtol=1e-9, atol=1e-12)
    for g_split, g_whole in zip(split_grads, whole_grads, strict=True):
        torch.testing.assert_close(g_split, g_whole, rtol=1e-8, atol=1e-12)
    # the recomputed context the step metrics report
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = train_batch(model, opt, batch, settings, ref, grad_clip=0.0, micro_batch_tokens=budget)
    assert metrics["recomputed_context_tokens"] == sum(m.num_tokens for m in micros) - batch.num_tokens > 0
