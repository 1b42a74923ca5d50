"""fp32 master weights and a ZeRO-1 sharded AdamW over the trainer's resizable data-parallel group.

`MasterAdamW` is the optimizer of a replica when `trainer.precision` is `bf16` or
`trainer.optimizer_sharding` is `zero1` (the default, fp32 without sharding, keeps a plain
`torch.optim.AdamW`: bit for bit today's path).

Precision (`master_dtype` set, bf16 compute):
    the model's parameters are bf16 and compute in bf16; every parameter has an fp32 *master* copy,
    which is what AdamW updates (its two moments are fp32 too). A post-accumulate-grad hook adds each
    bf16 gradient into an fp32 *main gradient* and frees the bf16 one, so gradients accumulate over
    micro-batches and are all-reduced in fp32. After each step the bf16 parameters are refreshed
    from the masters (round to nearest).
Sharding (`sharded`, ZeRO-1):
    the parameters are split into `size` disjoint sets (`assign_owners`: largest first, each onto the
    least-loaded rank, so each rank holds ~1/size of the bytes), and a rank keeps the master copy and
    the AdamW moments of its own set only. Gradients stay whole on every rank (the loop's
    gradient-accumulation scheme all-reduces them, see dp_group.py), so every rank computes the same
    clipping norm; each rank steps its set, and the updated parameters are broadcast from their
    owners (one broadcast per rank and dtype). Per parameter AdamW is the same arithmetic whichever
    rank runs it, so a sharded step equals the unsharded one bit for bit in fp32.
Resizing (at a micro-batch boundary, dp_group.ResizableDPGroup.apply):
    `send_shard_to_rank0` / `receive_shards` copy every rank's state to rank 0 over the old group
    (send/recv: only rank 0 holds the whole state, transiently), then the new group is formed and
    `send_state` / `receive_state` hand each rank its new set (sharded) or the whole state
    (unsharded). The optimizer's state is never changed by a resize, so a resized step stays exact.

Tensor parallelism (`set_tensor_parallel`, services/trainer/tp_replica.py):
    the optimizer holds one TP rank's parameters (its shards of split parameters, whole replicated
    ones); it shards them over its own data-parallel group like any other parameters, and clips to the
    whole model's norm (services/trainer/grad_clip.py: split parameters' squares summed over the TP
    group, replicated ones counted once).

Units: bytes for `state_bytes`; `lr` and `weight_decay` as in torch.optim.AdamW.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from services.trainer.collectives import flat_by_dtype, unflatten_into
from services.trainer.grad_clip import clip_over_tensor_parallel, is_split

MASTER = "master"  # the entry key of an fp32 master copy


def assign_owners(numels: list[int], size: int) -> list[int]:
    """The owning rank of each parameter: largest first, each onto the rank with the fewest elements so
    far (ties: the lower rank). Deterministic, so every rank computes the same assignment."""
    load = [0] * max(size, 1)
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(len(load)), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += numels[i]
    return owners


class MasterAdamW:
    """AdamW over fp32 masters (optional) and the shard of parameters this rank owns (optional).

    Guarantees: after `step`, every rank's model parameters are equal bit for bit (they are the
    owners' results, broadcast); the entries (master, exp_avg, exp_avg_sq, step) of each parameter
    live on exactly one rank when sharded, on every rank otherwise. Not thread-safe.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        weight_decay: float,
        master_dtype: torch.dtype | None,
        sharded: bool,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.weight_decay = lr, weight_decay
        self.master_dtype, self.sharded = master_dtype, sharded
        self.pg: Any = None
        self.rank, self.size = 0, 1
        self.tp_group: Any = None  # set under tensor parallelism: the clipping norm spans the TP group
        self.main_grads: list[torch.Tensor] | None = None
        if master_dtype is not None:
            self.main_grads = [torch.zeros(p.shape, dtype=master_dtype, device=p.device) for p in self.params]
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(self._fold_hook(i))
        self.template: dict[str, str] = {}  # AdamW's per-parameter state: key -> dtype name
        self.masters: dict[int, torch.Tensor] = {}
        self.inner: torch.optim.AdamW | None = None
        entries = {
            i: {MASTER: p.detach().to(master_dtype, copy=True)} if master_dtype else {}
            for i, p in enumerate(self.params)
        }
        self._install(entries)

    # -- gradients ---------------------------------------------------------------------------------

    def _fold_hook(self, i: int) -> Any:
        def fold(p: torch.Tensor) -> None:
            assert self.main_grads is not None and p.grad is not None
            self.main_grads[i].add_(p.grad)
            p.grad = None

        return fold

    def gradients(self) -> list[torch.Tensor]:
        """The gradient of every parameter that the step uses (fp32 main gradients with masters, else
        the parameters' own, allocated as zeros when missing), in parameter order on every rank."""
        if self.main_grads is not None:
            return self.main_grads
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params if p.grad is not None]

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the accumulated gradients (kept allocated unless `set_to_none`)."""
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        for g in self.main_grads or []:
            g.zero_()

    # -- the step ----------------------------------------------------------------------------------

    def set_tensor_parallel(self, tp_group: Any) -> None:
        """This optimizer holds one TP rank's parameters of a model split over `tp_group`: from now on
        the clipping norm is the whole model's (`grad_clip.clip_over_tensor_parallel`: split
        parameters' squares summed over the TP group, replicated ones counted once). The shards are
        unchanged: each TP rank shards its own parameters over its own data-parallel group (`pg`)."""
        self.tp_group = tp_group

    def step_and_clip(self, grad_clip: float) -> float:
        """Clip the gradient to global norm `grad_clip` (0: no clipping), step the owned parameters, then
        make every rank's parameters the owners'. Returns the pre-clip norm (0.0 without clipping)."""
        norm = 0.0
        if self.tp_group is not None:
            grads = self.gradients()
            split = [g for p, g in zip(self.params, grads, strict=True) if is_split(p)]
            replicated = [g for p, g in zip(self.params, grads, strict=True) if not is_split(p)]
            norm = clip_over_tensor_parallel(split, replicated, grad_clip, self.tp_group)
        elif self.main_grads is None:
            if grad_clip:
                norm = float(torch.nn.utils.clip_grad_norm_(self.params, grad_clip))
        elif grad_clip:  # the arithmetic of clip_grad_norm_, on the fp32 main gradients
            total = torch.nn.utils.get_total_norm(self.main_grads, 2.0)
            coef = torch.clamp(grad_clip / (total + 1e-6), max=1.0)
            torch._foreach_mul_(self.main_grads, coef)
            norm = float(total)
        if self.inner is not None:
            if self.main_grads is not None:
                for i, m in self.masters.items():
                    m.grad = self.main_grads[i]
            self.inner.step()
            with torch.no_grad():
                for i, m in self.masters.items():
                    m.grad = None
                    if self.main_grads is not None:
                        self.params[i].copy_(m)  # the compute copy refreshed from its master
            self._remember_template()
        if self.sharded and self.pg is not None:
            self._broadcast_params()
        return norm

    def _broadcast_params(self) -> None:
        owners = self.owners()
        for r in range(self.size):
            mine = [p for p, o in zip(self.params, owners, strict=True) if o == r]
            for flat, members in flat_by_dtype(mine):
                opts = torch.distributed.BroadcastOptions()
                opts.rootRank, opts.rootTensor = r, 0
                self.pg.broadcast([flat], opts).wait()
                unflatten_into(flat, members)

    # -- ownership and state -----------------------------------------------------------------------

    def owners(self) -> list[int]:
        """The rank owning each parameter's entries in the current group (all 0 when not sharded)."""
        if not self.sharded or self.size <= 1:
            return [0] * len(self.params)
        return assign_owners([p.numel() for p in self.params], self.size)

    def owned(self) -> list[int]:
        """Indices of the parameters whose entries this rank holds."""
        if not self.sharded:
            return list(range(len(self.params)))
        return [i for i, o in enumerate(self.owners()) if o == self.rank]

    def entries(self) -> dict[int, dict[str, torch.Tensor]]:
        """Parameter index -> its state on this rank: `master` (with masters) and AdamW's tensors."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for i, m in self.masters.items():
            entry = dict(self.inner.state.get(m, {})) if self.inner is not None else {}
            if self.master_dtype is not None:
                entry[MASTER] = m
            out[i] = entry
        return out

    def _install(self, entries: dict[int, dict[str, torch.Tensor]]) -> None:
        """Hold exactly `entries` (index -> state); AdamW is rebuilt over their masters."""
        self.masters = {}
        for i in sorted(entries):
            self.masters[i] = entries[i][MASTER] if self.master_dtype is not None else self.params[i]
        if not self.masters:
            self.inner = None
            return
        for m in self.masters.values():
            if self.master_dtype is not None:
                m.requires_grad_(True)
        self.inner = torch.optim.AdamW(
            list(self.masters.values()), lr=self.lr, weight_decay=self.weight_decay
        )
        for i, m in self.masters.items():
            state = {k: v for k, v in entries[i].items() if k != MASTER}
            if state:
                self.inner.state[m] = state

    def _remember_template(self) -> None:
        if not self.template and self.inner is not None:
            first = next(iter(self.masters.values()))
            state = self.inner.state.get(first, {})
            self.template = {
                k: str(v.dtype).removeprefix("torch.") for k, v in state.items() if torch.is_tensor(v)
            }

    def _entry_layout(self, i: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Keys, shapes and dtypes of parameter i's entry (what a receiver allocates)."""
        p = self.params[i]
        dtype = self.master_dtype or p.dtype
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for k, dt in sorted(self.template.items()):
            out[k] = ((), getattr(torch, dt)) if k == "step" else (tuple(p.shape), dtype)
        if self.master_dtype is not None:
            out[MASTER] = (tuple(p.shape), self.master_dtype)
        return out

    def _tensors_of(
        self, entries: dict[int, dict[str, torch.Tensor]], indices: list[int]
    ) -> list[torch.Tensor]:
        return [entries[i][k] for i in indices for k in sorted(self._entry_layout(i))]

    def _allocate(self, indices: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        device = self.params[0].device if self.params else torch.device("cpu")
        return {
            i: {
                k: torch.empty(shape, dtype=dt, device="cpu" if k == "step" else device)
                for k, (shape, dt) in self._entry_layout(i).items()
            }
            for i in indices
        }

    def layout(self) -> dict[str, Any]:
        """What a newcomer needs to allocate state like rank 0's (sent over the worker pipe)."""
        return {"template": dict(self.template)}

    def state_bytes(self) -> int:
        """Bytes of the optimizer state this rank holds: masters (when separate) + AdamW's tensors."""
        return sum(t.numel() * t.element_size() for e in self.entries().values() for t in e.values())

    # -- resizing ----------------------------------------------------------------------------------

    def set_group(self, pg: Any, rank: int, size: int) -> None:
        """Use `pg` (None: alone) as rank `rank` of `size` from now on; the state is not moved here."""
        self.pg, self.rank, self.size = pg, rank, size

    def send_shard_to_rank0(self, root: int = 0) -> None:
        """Every rank of the current group but `root` (rank 0 unless told): send a copy of the entries
        it owns to `root`. Its own entries and group are kept."""
        if self.rank == root or self.pg is None or not self.sharded:
            return
        mine = self.entries()
        for flat, _ in flat_by_dtype(self._tensors_of(mine, sorted(mine))):
            self.pg.send([flat], root, 0).wait()

    def receive_shards(self) -> None:
        """The current group's receiving rank (rank 0, or whichever rank the others send to with
        `send_shard_to_rank0(root)`): receive every other rank's entries, so it holds all of them;
        afterwards it is alone (no group: `set_group` again to keep using it)."""
        if self.pg is None or not self.sharded or self.size <= 1:
            return
        entries = self.entries()
        owners = self.owners()
        for r in range(self.size):
            if r == self.rank:
                continue
            theirs = [i for i, o in enumerate(owners) if o == r]
            got = self._allocate(theirs)
            for flat, members in flat_by_dtype(self._tensors_of(got, theirs)):
                self.pg.recv([flat], r, 0).wait()
                unflatten_into(flat, members)
            entries.update(got)
        self.pg, self.rank, self.size = None, 0, 1
        self._install(entries)

    def send_state(self) -> None:
        """Rank 0 of a new group (holding every entry): give each rank its own (sharded) or every entry
        (unsharded, one broadcast per dtype), then keep only its own."""
        entries = self.entries()
        if len(entries) != len(self.params):
            raise RuntimeError("rank 0 must hold every optimizer entry before a new group is formed")
        if self.pg is None or self.size <= 1:
            return
        if not self.sharded:
            opts = torch.distributed.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            for flat, _ in flat_by_dtype(self._tensors_of(entries, sorted(entries))):
                self.pg.broadcast([flat], opts).wait()
            return
        owners = self.owners()
        for r in range(1, self.size):
            theirs = [i for i, o in enumerate(owners) if o == r]
            for flat, _ in flat_by_dtype(self._tensors_of(entries, theirs)):
                self.pg.send([flat], r, 0).wait()
        self._install({i: e for i, e in entries.items() if owners[i] == 0})

    def receive_state(self, layout: dict[str, Any]) -> None:
        """Ranks >= 1 of a new group: drop what they held and receive their entries from rank 0."""
        self.template = dict(layout["template"])
        mine = self.owned()
        got = self._allocate(mine)
        tensors = self._tensors_of(got, mine)
        if self.sharded:
            for flat, members in flat_by_dtype(tensors):
                self.pg.recv([flat], 0, 0).wait()
                unflatten_into(flat, members)
        else:
            opts = torch.distributed.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            for flat, members in flat_by_dtype(tensors):
                self.pg.broadcast([flat], opts).wait()
                unflatten_into(flat, members)
        self._install(got)

    def load_entries(self, entries: dict[int, dict[str, torch.Tensor]]) -> None:
        """Hold exactly `entries` (parameter index -> master and AdamW's tensors, as `entries()` gives
        them), taking the AdamW state template from them (a replica seeded from another's state)."""
        for entry in entries.values():
            adam = {k: v for k, v in entry.items() if k != MASTER and torch.is_tensor(v)}
            if adam:
                self.template = {k: str(v.dtype).removeprefix("torch.") for k, v in adam.items()}
                break
        self._install(entries)

    def keep_own(self) -> None:
        """Drop the entries of parameters this rank does not own (after a gather that changed nothing)."""
        owned = set(self.owned())
        self._install({i: e for i, e in self.entries().items() if i in owned})

    def to(self, device: torch.device) -> None:
        """Move the masters, moments and main gradients onto `device` (rank 0 moving devices)."""
        moved = {
            i: {k: v if k == "step" else v.detach().to(device) for k, v in e.items()}
            for i, e in self.entries().items()
        }
        if self.main_grads is not None:
            self.main_grads = [g.to(device) for g in self.main_grads]
        self._install(moved)

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's entries keyed by parameter index, and the AdamW state template."""
        return {
            "format": "gyre-master-adamw",
            "template": dict(self.template),
            "entries": {i: {k: v.detach().clone() for k, v in e.items()} for i, e in self.entries().items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hold the entries of `state` that this rank owns (a full state: every rank finds its own)."""
        if state.get("format") != "gyre-master-adamw":
            raise ValueError(
                "this checkpoint's optimizer state is a plain AdamW one (trainer.precision fp32, no "
                "sharding); it cannot be restored into a trainer with bf16 masters or zero1 sharding"
            )
        self.template = dict(state["template"])
        device = self.params[0].device if self.params else torch.device("cpu")
        owned = set(self.owned())
        self._install(
            {
                int(i): {k: v if k == "step" else v.to(device) for k, v in e.items()}
                for i, e in state["entries"].items()
                if int(i) in owned
            }
        )
