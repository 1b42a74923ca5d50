"""bf16 compute with fp32 master weights tracks fp32 training; pure bf16 drifts (trainer.precision).

Three single-process trainers start from the same fp32 initial weights and take the same 20 steps
(five batches, cycled): fp32 (the reference), bf16 compute with fp32 masters, and pure bf16
(parameters and AdamW state in bf16, no masters). At lr 1e-4 an AdamW update (~1e-4) is about one
bf16 ulp of a weight of size ~0.02, so pure bf16 rounds many updates away; the masters keep them.

Measured on this machine (2026-12-05, default tiny model): weight error relative to the fp32 run's
total weight change, masters 0.0133, pure bf16 0.438; the largest loss
difference over the 20 steps relative to the mean |loss| 0.00067 with masters. The tolerances below
leave ~3x headroom over those.
"""

from __future__ import annotations

import pytest
import torch

from services.trainer.config import TrainerConfig
from services.trainer.sharded_optimizer import MASTER, MasterAdamW
from services.trainer.step import build_replica, train_batch
from tests.trainer.helpers import random_batch

NUM_STEPS = 20


def _train(**overrides) -> tuple[list[float], list[torch.Tensor], list[torch.Tensor], object]:
    """(losses, initial fp32 weights, final weights as fp32, optimizer) of a 20-step run."""
    cfg = TrainerConfig(device="cpu", micro_batch_tokens=40, **overrides)
    model, optimizer, ref, settings = build_replica(cfg, seed=0)
    if isinstance(optimizer, MasterAdamW) and optimizer.master_dtype is not None:
        initial = [e[MASTER].detach().clone() for _, e in sorted(optimizer.entries().items())]
    else:
        initial = [p.detach().float().clone() for p in model.parameters()]
    losses = []
    for k in range(NUM_STEPS):
        batch = random_batch(200 + k % 5, num_nodes=16, batch_id=f"b{k}", num_roots=6)
        metrics = train_batch(model, optimizer, batch, settings, ref, cfg.grad_clip, cfg.micro_batch_tokens)
        losses.append(metrics["loss"])
    return losses, initial, [p.detach().float().clone() for p in model.parameters()], optimizer


def _weight_error(got: list[torch.Tensor], want: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    """|got - want| over |want - start| (the distance travelled by the reference), over all weights."""
    num = sum(float(((a - b) ** 2).sum()) for a, b in zip(got, want, strict=True)) ** 0.5
    den = sum(float(((b - s) ** 2).sum()) for b, s in zip(want, start, strict=True)) ** 0.5
    return num / den


@pytest.mark.slow
def test_bf16_steps_with_fp32_masters_track_fp32_steps_and_pure_bf16_drifts_further():
    ref_losses, start, ref_final, _ = _train()
    master_losses, master_start, master_final, optimizer = _train(precision="bf16")
    pure_losses, _, pure_final, _ = _train(dtype="bfloat16")

    assert all(torch.equal(a, b) for a, b in zip(start, master_start, strict=True)), "same initial weights"
    assert isinstance(optimizer, MasterAdamW)
    masters = [e[MASTER].detach() for _, e in sorted(optimizer.entries().items())]
    assert all(m.dtype == torch.float32 for m in masters)
    compute = [p.dtype for p in optimizer.params]
    assert set(compute) == {torch.bfloat16}, "the model computes in bf16"

    master_error = _weight_error(masters, ref_final, start)
    pure_error = _weight_error(pure_final, ref_final, start)
    assert master_error < 0.04, master_error
    assert _weight_error(master_final, ref_final, start) < 0.2  # the bf16 compute copy: one rounding more
    assert pure_error > 3 * master_error, (pure_error, master_error)
    moved = max(float((b - s).abs().max()) for b, s in zip(ref_final, start, strict=True))
    assert moved > 1e-3, "the reference run did not move: the comparison would be vacuous"
    print(f"weight error: masters {master_error:.4f}, pure bf16 {pure_error:.4f}")

    scale = sum(abs(x) for x in ref_losses) / NUM_STEPS
    master_loss_gap = max(abs(a - b) for a, b in zip(master_losses, ref_losses, strict=True)) / scale
    print(f"largest loss gap over the mean |loss|: masters {master_loss_gap:.5f}")
    assert master_loss_gap < 0.002, master_loss_gap


def test_bf16_precision_refuses_a_non_fp32_master_dtype():
    with pytest.raises(ValueError, match="dtype must be float32"):
        TrainerConfig(precision="bf16", dtype="bfloat16")


def test_bf16_gradients_accumulate_in_fp32_main_gradients_and_the_bf16_ones_are_freed():
    cfg = TrainerConfig(device="cpu", precision="bf16", micro_batch_tokens=40)
    model, optimizer, _, settings = build_replica(cfg, seed=0)
    assert isinstance(optimizer, MasterAdamW) and optimizer.main_grads is not None
    from services.trainer.step import backward_micro, shard_loss_settings

    batch = random_batch(3, num_nodes=16, num_roots=6).to("cpu", torch.float32)
    micro = batch.micro_batches(40)
    assert len(micro) >= 2
    optimizer.zero_grad()
    backward_micro(model, micro[0], shard_loss_settings(settings), None)
    first = [g.clone() for g in optimizer.main_grads]
    backward_micro(model, micro[1], shard_loss_settings(settings), None)
    assert all(p.grad is None for p in model.parameters()), "bf16 gradients are folded and freed"
    assert all(g.dtype == torch.float32 for g in optimizer.main_grads)
    assert any(float(g.abs().sum()) > 0 for g in first)
    assert any(not torch.equal(a, b) for a, b in zip(first, optimizer.main_grads, strict=True)), "accumulated"


def test_the_reference_model_exists_only_with_a_kl_term_and_is_held_in_bf16():
    _, _, ref, _ = build_replica(TrainerConfig(device="cpu", kl_coef=0.0), seed=0)
    assert ref is None
    cfg = TrainerConfig(device="cpu", kl_coef=0.1, micro_batch_tokens=40)
    model, optimizer, ref, settings = build_replica(cfg, seed=0)
    assert ref is not None and {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in ref.parameters())
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.to(torch.bfloat16), b), "the reference is the initial weights, rounded"
    metrics = train_batch(model, optimizer, random_batch(7, num_nodes=16), settings, ref, 1.0, 40)
    # before any step the policy is the reference: the k3 KL is only bf16 rounding (>= 0, small)
    assert 0.0 <= metrics["kl_mean"] < 1e-3
    same = TrainerConfig(device="cpu", kl_coef=0.1, reference_precision="same")
    _, _, ref_same, _ = build_replica(same, seed=0)
    assert ref_same is not None and {p.dtype for p in ref_same.parameters()} == {torch.float32}
