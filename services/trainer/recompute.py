"""Activation recompute (`trainer.recompute_granularity`).

`full`: gyre.model.forward.hidden_states runs each transformer layer under torch.utils.checkpoint
(non-reentrant), so backward keeps only every layer's input [tokens, hidden] and runs the layer's
forward again when its gradient is needed. There is no dropout in the model, so the recomputed
activations are the ones of the first forward: loss and gradients equal those without recompute
(tests/trainer/test_recompute.py). Cost: about one more forward per step. Only while gradients are
enabled (the reference model and inference never recompute).
"""

from __future__ import annotations

from typing import Any


def enable_recompute(model: Any, on: bool) -> None:
    """Turn per-layer activation recompute of `model`'s training forward on or off."""
    model.gyre_recompute = bool(on)
