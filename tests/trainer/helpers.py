"""Builders of synthetic tree-packed batches (the trajectory service's output) for trainer tests."""

from __future__ import annotations

import asyncio
import random

import torch

from gyre.model.attention import TreeLayout
from gyre.model.forward import predecessor_index
from gyre.model.trees import TreeArrays, random_tree
from services.trainer.batch import PackedBatch


def batch_from_tree(
    tree: TreeArrays, rng: random.Random, batch_id: str = "b0", vocab: int = 512, with_paths: bool = False
) -> PackedBatch | tuple[PackedBatch, list[tuple[torch.Tensor, float, float]]]:
    """A packed batch over `tree` with random tokens, behaviour log-probs, advantages and norms.

    Weights follow the proto: weight_pos/neg sum w_p = A_p * norm_p by sign over the paths through
    a token, kl_weight sums norm_p. With `with_paths`, also returns (token indices, w_p, norm_p) per path.
    """
    t = tree.num_tokens
    layout = TreeLayout(t, tree.node_offsets, tree.node_lengths, tree.node_parents)
    pred = predecessor_index(layout)
    loss_mask = torch.tensor([rng.random() < 0.7 for _ in range(t)]) & (pred >= 0)
    w_pos, w_neg, kl_w = (torch.zeros(t, dtype=torch.float64) for _ in range(3))
    paths = []
    for tokens in layout.path_tokens():
        adv, norm = rng.uniform(-1.0, 1.0), rng.uniform(0.1, 1.0)
        w = adv * norm
        (w_pos if w >= 0 else w_neg)[tokens] += w
        kl_w[tokens] += norm
        paths.append((tokens, w, norm))
    behaviour = torch.tensor([-rng.uniform(4.0, 8.0) for _ in range(t)], dtype=torch.float64) * loss_mask
    batch = PackedBatch(
        batch_id,
        token_ids=torch.tensor([rng.randrange(vocab) for _ in range(t)]),
        position_ids=torch.tensor(tree.position_ids),
        node_offsets=tree.node_offsets,
        node_lengths=tree.node_lengths,
        node_parents=tree.node_parents,
        loss_mask=loss_mask,
        weight_pos=w_pos,
        weight_neg=w_neg,
        kl_weight=kl_w,
        behaviour_logprobs=behaviour,
        policy_versions=torch.where(loss_mask, 0, -1),
        num_paths=len(paths),
        num_flat_tokens=sum(len(p[0]) for p in paths),
    )
    return (batch, paths) if with_paths else batch


def random_batch(seed: int, num_nodes: int = 8, batch_id: str = "b0", num_roots: int = 2) -> PackedBatch:
    rng = random.Random(seed)
    out = batch_from_tree(random_tree(rng, num_nodes, max_len=6, num_roots=num_roots), rng, batch_id)
    assert isinstance(out, PackedBatch)
    return out


class DeviceSchedule:
    """Plays a schedule of held devices on a trainer loop at its micro-batch boundaries.

    At boundary k (boundary 0 comes before the first pull) the trainer holds `schedule[k]`, the last
    entry from then on, and its data-parallel group is resized before the micro-batch. An empty
    entry parks the loop at that boundary; the last entry is handed back 0.3 s later and the loop
    woken. `check(boundary)` runs after each resize (boundary counted from 1), where a test asserts
    what must hold there. `boundaries` counts the boundaries seen.
    """

    def __init__(self, trainer, schedule: list[list[str]], check=None) -> None:  # type: ignore[no-untyped-def]
        self.trainer, self.schedule, self.check = trainer, schedule, check
        self.boundaries = 0
        trainer.boundary_hooks.append(self._at_boundary)
        trainer.set_devices(schedule[0])

    async def _give_back_later(self) -> None:
        await asyncio.sleep(0.3)  # the loop is parked at the boundary meanwhile
        self.trainer.set_devices(self.schedule[-1])
        await self.trainer.wake()

    async def _at_boundary(self) -> None:
        held = self.schedule[min(self.boundaries, len(self.schedule) - 1)]
        self.boundaries += 1
        self.trainer.set_devices(held)
        if not held:
            asyncio.get_running_loop().create_task(self._give_back_later())
            return
        await asyncio.to_thread(self.trainer.dp.apply, True)  # joiners are ready before the micro-batch
        if self.check is not None:
            await self.check(self.boundaries)
