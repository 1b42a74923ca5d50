"""The tree-packed loss equals training every root-to-leaf path as its own sample (float64), and
the algorithm's terms (clip-higher, entropy bonus with a floor) and metrics do what they say."""

from __future__ import annotations

import math
import random

import pytest
import torch

from gyre.model import ModelConfig, build_model, causal_logits
from gyre.model.trees import random_tree
from services.trainer.batch import from_chunks, to_chunk
from services.trainer.loss import (
    LossSettings,
    batch_logprobs,
    batch_logprobs_and_entropy,
    clipped_token_losses,
    k3_kl,
    tree_loss,
)
from tests.trainer.helpers import batch_from_tree, random_batch


def _flat_loss(model, ref, batch, paths, settings):
    """Every path as its own causal sample with its own advantage sign and norm."""
    total = torch.zeros((), dtype=torch.float64)
    for tokens, w, norm in paths:
        ids, pos = batch.token_ids[tokens], batch.position_ids[tokens]
        lp_all = causal_logits(model, ids[None], pos[None])[0].log_softmax(-1)
        lp = torch.zeros(len(tokens), dtype=torch.float64)
        lp[1:] = lp_all[:-1].gather(-1, ids[1:, None])[:, 0]
        mask = batch.loss_mask[tokens]
        wp = torch.full_like(lp, max(w, 0.0))
        wn = torch.full_like(lp, min(w, 0.0))
        per_token, _ = clipped_token_losses(
            lp, batch.behaviour_logprobs[tokens], wp, wn, mask, settings.clip_eps, settings.clip_eps_high
        )
        total = total + per_token.sum()
        if settings.entropy_coef:
            ent = torch.zeros_like(lp)
            ent[1:] = -(lp_all[:-1].exp() * lp_all[:-1]).sum(-1)
            if settings.entropy_target is not None:
                ent = ent.clamp(max=settings.entropy_target)
            total = total - settings.entropy_coef * norm * torch.where(mask, ent, torch.zeros_like(ent)).sum()
        if settings.kl_coef:
            with torch.no_grad():
                ref_all = causal_logits(ref, ids[None], pos[None])[0].log_softmax(-1)
                ref_lp = torch.zeros_like(lp)
                ref_lp[1:] = ref_all[:-1].gather(-1, ids[1:, None])[:, 0]
            kl = torch.where(mask, k3_kl(lp, ref_lp), torch.zeros_like(lp))
            total = total + settings.kl_coef * norm * kl.sum()
    return total


@pytest.mark.parametrize(
    "seed,kl_coef,backend,entropy_coef,entropy_target",
    [
        (0, 0.0, "dense", 0.0, None),
        (1, 0.1, "nodes", 0.0, None),
        (2, 0.05, "dense", 0.0, None),
        (3, 0.0, "nodes", 0.1, None),
        (4, 0.05, "dense", 0.1, 5.0),
    ],
)
def test_tree_loss_and_gradients_equal_training_every_path_separately(
    seed, kl_coef, backend, entropy_coef, entropy_target
):
    cfg = ModelConfig(num_query_groups=2, attention_backend=backend)
    model = build_model(cfg, dtype=torch.float64, seed=seed)
    ref = build_model(cfg, dtype=torch.float64, seed=seed + 100)
    rng = random.Random(seed)
    batch, paths = batch_from_tree(random_tree(rng, 9, max_len=5, num_roots=2), rng, with_paths=True)
    batch = batch.to("cpu", torch.float64)
    # Behaviour log-probs near the model's, so some ratios clip on each side and some do not.
    with torch.no_grad():
        lp = batch_logprobs(model, batch)
    noise = torch.tensor([rng.uniform(-0.4, 0.4) for _ in range(batch.num_tokens)], dtype=torch.float64)
    batch.behaviour_logprobs = torch.where(batch.loss_mask, lp + noise, torch.zeros_like(lp))
    settings = LossSettings(
        clip_eps=0.2,
        clip_eps_high=0.28,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        entropy_target=entropy_target,
    )

    tree, _ = tree_loss(model, batch, settings, ref)
    tree_grads = torch.autograd.grad(tree, list(model.parameters()))
    flat = _flat_loss(model, ref, batch, paths, settings)
    flat_grads = torch.autograd.grad(flat, list(model.parameters()))

    assert len(paths) >= 3 and batch.num_tokens < sum(len(p[0]) for p in paths)  # it really branches
    torch.testing.assert_close(tree, flat, rtol=1e-5, atol=0)
    for g_tree, g_flat in zip(tree_grads, flat_grads, strict=True):
        torch.testing.assert_close(g_tree, g_flat, rtol=1e-5, atol=1e-12)


def test_positive_and_negative_weights_clip_on_opposite_sides():
    ratio_log = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5], dtype=torch.float64))
    mask = torch.ones(4, dtype=torch.bool)
    one = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    per_token, _ = clipped_token_losses(
        ratio_log, torch.zeros(4, dtype=torch.float64), one, one - 1, mask, 0.2
    )
    # A>0: min(r, clip(r)) -> 1.2 and 0.5; A<0: max(r, clip(r)) -> 1.5 and 0.8.
    torch.testing.assert_close(per_token, torch.tensor([-1.2, 1.5, -0.5, 0.8], dtype=torch.float64))


def test_batch_survives_the_wire_and_splits_into_shards_whose_losses_add_up():
    model = build_model(ModelConfig(), dtype=torch.float64, seed=0)
    batch = random_batch(3, num_nodes=10, num_roots=3).to("cpu", torch.float64)
    wire = from_chunks(
        [
            to_chunk(batch.select_trees(batch.tree_ranges()[:1]), 0, False),
            to_chunk(batch.select_trees(batch.tree_ranges()[1:]), 1, True),
        ]
    )
    assert wire.node_parents == batch.node_parents and torch.equal(wire.token_ids, batch.token_ids)
    settings = LossSettings()
    whole, _ = tree_loss(model, batch, settings)
    parts = [tree_loss(model, shard, settings)[0] for shard in batch.split(2)]
    torch.testing.assert_close(whole, parts[0] + parts[1], rtol=1e-10, atol=1e-12)


def test_clip_higher_lets_a_positive_advantage_ratio_rise_further_than_a_negative_one_falls():
    ratio_log = torch.log(torch.tensor([1.5, 1.25, 0.5, 0.5], dtype=torch.float64))
    mask = torch.ones(4, dtype=torch.bool)
    pos = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    per_token, _ = clipped_token_losses(
        ratio_log, torch.zeros(4, dtype=torch.float64), pos, pos - 1, mask, 0.2, clip_eps_high=0.28
    )
    # A>0 clips at 1.28 above (1.25 passes), A<0 still at 0.8 below.
    torch.testing.assert_close(per_token, torch.tensor([-1.28, -1.25, -0.5, 0.8], dtype=torch.float64))


def _one_tree_batch(seed: int, model):
    rng = random.Random(seed)
    batch = batch_from_tree(random_tree(rng, 9, max_len=5, num_roots=2), rng)
    batch = batch.to("cpu", torch.float64)
    with torch.no_grad():
        batch.behaviour_logprobs = torch.where(batch.loss_mask, batch_logprobs(model, batch), 0.0)
    return batch


def test_metrics_report_entropy_kl_and_clip_fraction_of_the_trained_tokens():
    cfg = ModelConfig(num_query_groups=2)
    model = build_model(cfg, dtype=torch.float64, seed=0)
    batch = _one_tree_batch(0, model)
    _, on_policy = tree_loss(model, batch, LossSettings())
    assert on_policy["kl_behaviour"] == pytest.approx(0.0, abs=1e-12)
    assert on_policy["clip_fraction"] == 0.0
    logits = causal_logits(model, batch.token_ids[None], batch.position_ids[None])[0]
    assert 0.0 < on_policy["entropy"] <= math.log(logits.shape[-1])  # nats, at most log(vocab)
    # tokens sampled by another policy: positive KL, and ratios beyond the clip range are counted
    batch.behaviour_logprobs = torch.where(batch.loss_mask, batch.behaviour_logprobs - 0.5, 0.0)
    _, stale = tree_loss(model, batch, LossSettings(clip_eps=0.2, clip_eps_high=0.28))
    assert stale["kl_behaviour"] == pytest.approx(math.exp(0.5) - 1 - 0.5, rel=1e-9)
    assert stale["clip_fraction"] == 1.0  # every ratio is e^0.5 = 1.65 > 1.28


def test_entropy_bonus_raises_entropy_and_the_floor_stops_it_above_the_target():
    cfg = ModelConfig(num_query_groups=2, init_std=0.5)
    model = build_model(cfg, dtype=torch.float64, seed=1)
    batch = _one_tree_batch(1, model)
    batch.weight_pos.zero_()
    batch.weight_neg.zero_()  # no reward signal: only the bonus acts
    _, before = tree_loss(model, batch, LossSettings())
    loss, _ = tree_loss(model, batch, LossSettings(entropy_coef=1.0))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads, strict=True):
            p -= 0.05 * g
    _, after = tree_loss(model, batch, LossSettings())
    assert after["entropy"] > before["entropy"]
    # a floor below every trained token's entropy: the bonus is flat there, so it adds no gradient
    _, per_token_entropy = batch_logprobs_and_entropy(model, batch)
    assert float(per_token_entropy[batch.loss_mask].min()) > 1e-6
    capped, _ = tree_loss(model, batch, LossSettings(entropy_coef=1.0, entropy_target=1e-6))
    capped_grads = torch.autograd.grad(capped, list(model.parameters()), allow_unused=True)
    assert all(g is None or float(g.abs().max()) == 0.0 for g in capped_grads)
