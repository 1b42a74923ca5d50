"""Batch advantage normalisation (`trainer.normalise_batch_advantages`): the policy-gradient term is
divided by the RMS of the batch's token advantages, so the step does not depend on the reward scale."""

from __future__ import annotations

import math
import random

import pytest
import torch

from gyre.model import ModelConfig, build_model
from gyre.model.trees import random_tree
from services.trainer.batch import PackedBatch
from services.trainer.config import TrainerConfig
from services.trainer.loss import LossSettings, advantage_rms, batch_logprobs, tree_loss
from tests.trainer.helpers import batch_from_tree


def _batch(seed: int, model) -> tuple[PackedBatch, list[tuple[torch.Tensor, float, float]]]:
    rng = random.Random(seed)
    batch, paths = batch_from_tree(random_tree(rng, 9, max_len=5, num_roots=2), rng, with_paths=True)
    batch = batch.to("cpu", torch.float64)
    with torch.no_grad():  # sampled by the current weights: every ratio is 1
        batch.behaviour_logprobs = torch.where(batch.loss_mask, batch_logprobs(model, batch), 0.0)
    return batch, paths


def _scaled(batch: PackedBatch, c: float) -> PackedBatch:
    """The same batch with every path's advantage multiplied by c (norms unchanged)."""
    out = batch.to("cpu", torch.float64)
    out.weight_pos = batch.weight_pos * c
    out.weight_neg = batch.weight_neg * c
    return out


def test_advantage_rms_is_the_rms_over_every_paths_trained_tokens_weighted_by_norm():
    model = build_model(ModelConfig(num_query_groups=2), dtype=torch.float64, seed=0)
    batch, paths = _batch(0, model)
    # by hand: a token's advantage is the norm-weighted mean of the paths through it
    num = torch.zeros(batch.num_tokens, dtype=torch.float64)
    den = torch.zeros(batch.num_tokens, dtype=torch.float64)
    for tokens, w, norm in paths:
        num[tokens] += w
        den[tokens] += norm
    trained = batch.loss_mask
    a = num[trained] / den[trained]
    expected = math.sqrt(float((den[trained] * a * a).sum() / den[trained].sum()))
    assert expected > 0.0
    assert advantage_rms(batch) == pytest.approx(expected, rel=1e-12)


def test_normalised_loss_and_gradient_do_not_depend_on_the_reward_scale():
    model = build_model(ModelConfig(num_query_groups=2), dtype=torch.float64, seed=1)
    batch, _ = _batch(1, model)
    params = list(model.parameters())
    on, off = LossSettings(normalise_advantages=True), LossSettings()

    def loss_and_grads(b: PackedBatch, s: LossSettings) -> tuple[torch.Tensor, list[torch.Tensor]]:
        loss, _ = tree_loss(model, b, s)
        return loss.detach(), [g.detach() for g in torch.autograd.grad(loss, params)]

    base_loss, base_grads = loss_and_grads(batch, on)
    big_loss, big_grads = loss_and_grads(_scaled(batch, 40.0), on)
    torch.testing.assert_close(big_loss, base_loss, rtol=1e-9, atol=1e-12)
    for g0, g1 in zip(base_grads, big_grads, strict=True):
        torch.testing.assert_close(g1, g0, rtol=1e-8, atol=1e-12)
    # without it the policy-gradient term scales with the rewards, and with it it is that / RMS
    raw_loss, _ = loss_and_grads(batch, off)
    raw_big, _ = loss_and_grads(_scaled(batch, 40.0), off)
    torch.testing.assert_close(raw_big, 40.0 * raw_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(base_loss, raw_loss / advantage_rms(batch), rtol=1e-9, atol=1e-12)


def test_a_batch_without_advantages_is_not_scaled_and_the_entropy_bonus_is_not_divided():
    model = build_model(ModelConfig(num_query_groups=2), dtype=torch.float64, seed=2)
    batch, _ = _batch(2, model)
    zero = _scaled(batch, 0.0)
    assert advantage_rms(zero) == 0.0
    bonus = LossSettings(entropy_coef=0.1)
    loss_on, metrics = tree_loss(model, zero, LossSettings(entropy_coef=0.1, normalise_advantages=True))
    loss_off, _ = tree_loss(model, zero, bonus)
    assert metrics["advantage_rms"] == 0.0 and torch.isfinite(loss_on)
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-12, atol=1e-12)
    # with advantages, only the policy-gradient part is divided: the bonus keeps its weight
    pg_only = tree_loss(model, batch, LossSettings(normalise_advantages=True))[0]
    with_bonus = tree_loss(model, batch, LossSettings(entropy_coef=0.1, normalise_advantages=True))[0]
    torch.testing.assert_close(with_bonus - pg_only, loss_off, rtol=1e-9, atol=1e-12)


def test_the_trainer_config_field_reaches_the_loss_settings():
    assert LossSettings.from_config(TrainerConfig()).normalise_advantages is False
    assert LossSettings.from_config(TrainerConfig(normalise_batch_advantages=True)).normalise_advantages


def test_a_step_is_normalised_as_a_whole_however_it_is_cut_into_micro_batches(tmp_path):
    """The trainer divides by the step's RMS before cutting it: a step of several micro-batches equals
    the loss of the whole batch with normalisation (as examples/rl_loop.py computes it), which a
    division per micro-batch would not."""
    import asyncio

    from services.trainer.loop import Trainer
    from tests.trainer.helpers import random_batch

    batch = random_batch(7, num_nodes=24, batch_id="b0", num_roots=8)

    class OneBatch:  # the outermost edge: stands in for the trajectory service
        def __init__(self) -> None:
            self.left = [batch]

        async def pull(self, current_version: int, resume_batch_id: str = ""):
            return self.left.pop(0) if self.left else None

        async def ack(self, batch_id: str, version: int) -> None:
            pass

    def run(micro_batch_tokens: int) -> tuple[dict[str, float], Trainer]:
        cfg = TrainerConfig(
            dtype="float64",
            device="cpu",
            lr=1e-2,
            checkpoint_every=100,
            pull_wait_s=0,
            micro_batch_tokens=micro_batch_tokens,
            normalise_batch_advantages=True,
        )
        got: list[dict[str, float]] = []

        async def sink(weights, metrics):
            got.append(metrics)

        trainer = Trainer(cfg, tmp_path / str(micro_batch_tokens), OneBatch(), sink, seed=0)
        try:
            asyncio.run(trainer.run(max_steps=1))
        finally:
            trainer.close()
        return got[0], trainer

    whole, one = run(10_000)
    cut, many = run(40)
    assert whole["num_micro_batches"] == 1 and cut["num_micro_batches"] >= 2
    cfg = TrainerConfig(dtype="float64", device="cpu", checkpoint_every=100, normalise_batch_advantages=True)
    fresh = Trainer(cfg, tmp_path / "fresh", OneBatch(), None, seed=0)  # type: ignore[arg-type]
    settings = LossSettings.from_config(cfg)  # the whole batch, divided by its own RMS in tree_loss
    expected, _ = tree_loss(fresh.model, batch.to("cpu", torch.float64), settings)
    fresh.close()
    assert whole["advantage_rms"] == pytest.approx(advantage_rms(batch.to("cpu", torch.float64)), rel=1e-9)
    assert cut["loss"] == pytest.approx(whole["loss"], rel=1e-9)
    assert whole["loss"] == pytest.approx(float(expected), rel=1e-9)
    for a, b in zip(many.model.parameters(), one.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
