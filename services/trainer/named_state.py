"""A replica's optimizer state and gradients keyed by parameter name, for either optimizer kind.

The TP replicas and the trainer's whole-model mirror (`tp_replica.py`, `tp_mirror.py`) exchange state
by parameter name: the replicas hold TP shards, the mirror full (TP = 1) tensors, and both build the
same model, so names match. Two optimizer kinds:

    torch.optim.AdamW   per parameter {step, exp_avg, exp_avg_sq}, in `optimizer.state[param]`
    MasterAdamW         per parameter index {master (with bf16 masters), step, exp_avg, exp_avg_sq},
                        the entries this rank holds (`MasterAdamW.entries`); gradients are its fp32
                        main gradients when it keeps masters

Guarantee: `load_optimizer_state(model, opt, optimizer_state(model2, opt2), ...)` on the same layout
reproduces every tensor bit for bit (copies, not views).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from services.trainer.dp_group import gradient_tensors
from services.trainer.sharded_optimizer import MASTER, MasterAdamW

Cut = Callable[[str, torch.Tensor], torch.Tensor]  # (name, full tensor) -> this rank's part of it


def trainable_names(model: Any) -> list[str]:
    """Names of the trainable parameters, in `model.parameters()` order (a MasterAdamW's order)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def optimizer_state(model: Any, optimizer: Any) -> dict[str, dict[str, Any]]:
    """name -> copies of the optimizer entries this rank holds for that parameter (none: absent)."""
    if isinstance(optimizer, MasterAdamW):
        names = trainable_names(model)
        return {
            names[i]: {k: v.detach().clone() for k, v in entry.items()}
            for i, entry in optimizer.entries().items()
            if entry
        }
    return {
        n: {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
        for n, p in model.named_parameters()
        if optimizer.state.get(p)
    }


def load_optimizer_state(
    model: Any,
    optimizer: Any,
    state: dict[str, dict[str, Any]],
    full_weights: dict[str, torch.Tensor],
    cut: Cut | None = None,
) -> None:
    """Hold exactly `state` (as `optimizer_state` gives it, tensors of full shape when `cut` is given,
    which cuts this rank's part of each tensor shaped like its parameter's full weight). A MasterAdamW
    then holds every parameter's entry (a group of one: `set_group` and `sync_replica` shard it); a
    parameter without a master in `state` gets one from `full_weights` (its initial weights)."""
    params = dict(model.named_parameters())

    def part(name: str, v: Any) -> Any:
        if not torch.is_tensor(v):
            return v
        if cut is not None and v.shape == full_weights[name].shape:
            return cut(name, v).clone()
        return v.detach().clone()

    if isinstance(optimizer, MasterAdamW):
        optimizer.set_group(None, 0, 1)
        entries: dict[int, dict[str, torch.Tensor]] = {}
        for i, name in enumerate(trainable_names(model)):
            entry = {k: part(name, v) for k, v in state.get(name, {}).items()}
            if optimizer.master_dtype is not None and MASTER not in entry:
                entry[MASTER] = part(name, full_weights[name]).to(optimizer.master_dtype)
            if MASTER in entry:
                entry[MASTER] = entry[MASTER].to(params[name].device)
            entries[i] = entry
        optimizer.load_entries(entries)
        return
    optimizer.state.clear()
    for name, entry in state.items():
        optimizer.state[params[name]] = {k: part(name, v) for k, v in entry.items()}


def gradients(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """name -> the gradient the step uses (a MasterAdamW's main gradient with masters; zeros when a
    parameter has none yet). The tensors themselves, not copies."""
    return dict(zip(trainable_names(model), gradient_tensors(model, optimizer), strict=True))


def load_gradients(
    model: Any, optimizer: Any, grads: dict[str, torch.Tensor], cut: Cut | None = None
) -> None:
    """Set the step's gradient so far to `grads` (full shapes when `cut` is given); a parameter
    missing from `grads` gets none (plain AdamW) or zeros (a MasterAdamW's main gradient)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        if isinstance(optimizer, MasterAdamW) and optimizer.main_grads is not None:
            for i, name in enumerate(trainable_names(model)):
                g = grads.get(name)
                main = optimizer.main_grads[i]
                if g is None:
                    main.zero_()
                else:
                    main.copy_(cut(name, g) if cut is not None else g)
            return
        for name, p in params.items():
            g = grads.get(name)
            p.grad = None if g is None else (cut(name, g) if cut is not None else g).to(p.dtype).clone()
