"""The chunked log-prob / entropy equals the full log-softmax, in values and gradients (float64)."""

from __future__ import annotations

import pytest
import torch

from gyre.model import ModelConfig, build_model
from services.trainer.chunked_softmax import chunked_logprob_entropy, full_logprob_entropy
from services.trainer.loss import LossSettings, batch_logprobs_and_entropy, tree_loss
from tests.trainer.helpers import random_batch


def _inputs(seed: int, n: int = 37, h: int = 16, v: int = 101) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    up_lp = torch.randn(n, generator=g, dtype=torch.float64)
    up_h = torch.randn(n, generator=g, dtype=torch.float64)
    return hidden, weight, targets, up_lp, up_h


@pytest.mark.parametrize("chunk", [1, 5, 37, 64])
def test_chunked_values_and_gradients_equal_the_full_computation(chunk: int) -> None:
    hidden, weight, targets, up_lp, up_h = _inputs(chunk)
    lp_full, ent_full = full_logprob_entropy(hidden, weight, targets)
    g_full = torch.autograd.grad((lp_full * up_lp).sum() + (ent_full * up_h).sum(), (hidden, weight))
    lp, ent = chunked_logprob_entropy(hidden, weight, targets, chunk)
    g = torch.autograd.grad((lp * up_lp).sum() + (ent * up_h).sum(), (hidden, weight))
    torch.testing.assert_close(lp, lp_full, rtol=1e-6, atol=1e-10)
    torch.testing.assert_close(ent, ent_full, rtol=1e-6, atol=1e-10)
    for a, b in zip(g, g_full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-10)


def test_gradient_of_one_output_alone_is_right() -> None:
    """Only the entropy used (the log-prob's upstream gradient is None), and only the log-prob."""
    hidden, weight, targets, _, _ = _inputs(7)
    for pick in (0, 1):
        full = full_logprob_entropy(hidden, weight, targets)[pick].sum()
        want = torch.autograd.grad(full, (hidden, weight))
        got = torch.autograd.grad(
            chunked_logprob_entropy(hidden, weight, targets, 4)[pick].sum(), (hidden, weight)
        )
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-10)


def test_the_tree_loss_is_the_same_for_any_chunk_size() -> None:
    """The whole loss (PG + entropy bonus) and the model's gradients do not depend on the chunk size."""
    model = build_model(ModelConfig(num_query_groups=2), dtype=torch.float64, seed=3)
    batch = random_batch(seed=3).to("cpu", torch.float64)
    results = []
    for chunk in (3, batch.num_tokens):
        model.zero_grad(set_to_none=True)
        loss, _ = tree_loss(model, batch, LossSettings(entropy_coef=0.1, chunk_tokens=chunk))
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-12)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)
    lp, ent = batch_logprobs_and_entropy(model, batch, 3)
    assert lp.dtype == torch.float64 and bool((ent >= 0).all())


def test_chunk_size_below_one_is_refused() -> None:
    hidden, weight, targets, _, _ = _inputs(0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_logprob_entropy(hidden, weight, targets, 0)
