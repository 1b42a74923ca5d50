"""The tree-packed loss equals training every root-to-leaf path as its own sample (float64)."""

from __future__ import annotations

import random

import pytest
import torch

from gyre.model import ModelConfig, build_model, causal_logits
from gyre.model.trees import random_tree
from services.trainer.batch import from_chunks, to_chunk
from services.trainer.loss import LossSettings, clipped_token_losses, k3_kl, tree_loss
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
            lp, batch.behaviour_logprobs[tokens], wp, wn, mask, settings.clip_eps
        )
        total = total + per_token.sum()
        if settings.kl_coef:
            with torch.no_grad():
                ref_all = causal_logits(ref, ids[None], pos[None])[0].log_softmax(-1)
                ref_lp = torch.zeros_like(lp)
                ref_lp[1:] = ref_all[:-1].gather(-1, ids[1:, None])[:, 0]
            kl = torch.where(mask, k3_kl(lp, ref_lp), torch.zeros_like(lp))
            total = total + settings.kl_coef * norm * kl.sum()
    return total


@pytest.mark.parametrize("seed,kl_coef,backend", [(0, 0.0, "dense"), (1, 0.1, "nodes"), (2, 0.05, "dense")])
def test_tree_loss_and_gradients_equal_training_every_path_separately(seed, kl_coef, backend):
    cfg = ModelConfig(num_query_groups=2, attention_backend=backend)
    model = build_model(cfg, dtype=torch.float64, seed=seed)
    ref = build_model(cfg, dtype=torch.float64, seed=seed + 100)
    rng = random.Random(seed)
    batch, paths = batch_from_tree(random_tree(rng, 9, max_len=5, num_roots=2), rng, with_paths=True)
    batch = batch.to("cpu", torch.float64)
    # Behaviour log-probs near the model's, so some ratios clip on each side and some do not.
    with torch.no_grad():
        from services.trainer.loss import batch_logprobs

        lp = batch_logprobs(model, batch)
    noise = torch.tensor([rng.uniform(-0.4, 0.4) for _ in range(batch.num_tokens)], dtype=torch.float64)
    batch.behaviour_logprobs = torch.where(batch.loss_mask, lp + noise, torch.zeros_like(lp))
    settings = LossSettings(clip_eps=0.2, kl_coef=kl_coef)

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
