"""The trainer process's whole-model mirror of tensor-parallel replicas (trainer.tensor_parallel_size > 1).

With TP the step runs in the replicas' processes (`tp_replica.TensorParallelReplicas`), while the step
loop keeps writing checkpoints and publishing weights from its own TP = 1 model and AdamW, as it does
without TP. That model is a mirror:

    after every optimizer step   the replicas' weights, gathered to full shapes, are copied into it
                                 (what published versions hold)
    before each checkpoint       their optimizer state too (ZeRO-1 shards gathered), so checkpoints
                                 hold the whole state while a step moves only the weights
    the last replica leaves      the whole state, the step's gradient so far included, is copied into
                                 it (`keep`), so a step survives holding no device
    a group forms from none      its replicas start from it (`seed`): weights, reference weights,
                                 AdamW state and the gradient so far, each TP rank cutting its shards
                                 (at start-up that is the checkpoint the loop restored)

Cost: the trainer process holds the whole model and optimizer state in its own memory (on the CPU);
each step gathers the weights once over the TP group and sends them over the replica pipe, and each
checkpoint the optimizer state as well.
"""

from __future__ import annotations

from typing import Any

import torch

from services.trainer import named_state
from services.trainer.sharded_optimizer import MasterAdamW
from services.trainer.tp_replica import FullState


def mirror_state(model: Any, optimizer: Any, ref_model: Any | None) -> FullState:
    """The mirror's state as a seed for a new group (copies: the seed is pickled to the replicas).
    The optimizer's entries by name (`named_state.optimizer_state`: a MasterAdamW's masters too), the
    gradients the step uses so far (a MasterAdamW's main gradients; a plain AdamW's where present)."""
    params = dict(model.named_parameters())
    if isinstance(optimizer, MasterAdamW):
        grads = {n: g.detach().clone() for n, g in named_state.gradients(model, optimizer).items()}
    else:
        grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
    state: FullState = {
        "weights": {n: p.detach().clone() for n, p in params.items()},
        "grads": grads,
        "optimizer": named_state.optimizer_state(model, optimizer),
    }
    if ref_model is not None:
        state["reference"] = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    return state


def load_mirror(model: Any, optimizer: Any, state: FullState, grads: bool) -> None:
    """Copy a gathered state into the mirror: weights and optimizer state (a MasterAdamW's masters
    included), and with `grads` the gradients (left as they are otherwise)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state["weights"].items():
            params[name].copy_(value)
    if state.get("optimizer"):  # a weights-only gather (TensorParallelReplicas.full_state) leaves it
        named_state.load_optimizer_state(model, optimizer, state["optimizer"], state["weights"])
    if grads:
        named_state.load_gradients(model, optimizer, state.get("grads", {}))
