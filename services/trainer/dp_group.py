"""Elastic data parallelism: one rank per TRAIN device held, resized at micro-batch boundaries.

Rank 0 is the trainer process itself; ranks 1..n-1 are worker processes (multiprocessing
'spawn', one per additional device), each holding a full replica of the model, optimizer and
(with KL) reference model. Membership changes only in `apply`, which the loop calls at
micro-batch boundaries, and every membership is a new *generation*: a fresh process group built
from a `PrefixStore("gyre-dp/<generation>", TCPStore)` hosted by rank 0 — separate from
Megatron's one-process default world, which never changes size. Backend: gloo for CPU replicas,
NCCL for CUDA replicas (scripts/gpu_check.sh exercises it; CI has no GPU).

A step is a sequence of micro-batches (gradient accumulation), and the group may change between
any two of them:
    micro-batch k:  rank 0 splits it into `size` shards of whole trees and sends shard r to rank r;
                    ranks >= 1 zero their gradients, every rank backpropagates its shard's loss (a sum
                    over tokens), and one all-reduce sums the gradients. Rank 0 never zeroes inside
                    a step, so after the all-reduce *every* rank holds the step's gradient so far.
    finish:         every rank clips and steps on that same gradient.
Hence a rank that leaves takes nothing with it, a rank that joins mid-step needs only the
parameters and optimizer state (broadcast at the join; unchanged inside a step), and the step
equals the single-process step over the same micro-batches up to float summation order
(tests/trainer/test_elastic_dp.py: float64, rtol 1e-6).

Guarantees
- After every resize, every replica holds rank 0's parameters, reference parameters and
  optimizer state bit for bit (rank 0 broadcasts them to the whole new group).
- Ranks are tied to devices: a released device's rank has left the group when `apply` returns;
  on a GPU its process has exited (the device is free). A logical CPU slot's worker is kept as a
  spare, outside every group (even while still booting), and serves the next slot granted (no
  new process start-up). When rank 0's own device is released while others are held, rank 0 moves onto
  one of them (the worker there retires); with no device held, rank 0 is parked on the CPU.
- Growing starts workers without blocking; they join at the first boundary after they are ready
  (or at once with `apply(wait=True)`).
- A worker that dies or fails makes the next collective or pipe read raise (the collective
  timeout bounds a hang), which ends the trainer's step loop; the run resumes from its checkpoint.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import multiprocessing
import pickle
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from services.trainer.batch import PackedBatch
from services.trainer.collectives import flat_by_dtype, unflatten_into
from services.trainer.dist_checkpoint import save_shard
from services.trainer.rendezvous import LOCAL_HOST, gloo_device, host_store, join_store
from services.trainer.sharded_optimizer import MasterAdamW

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 300.0  # a collective waiting longer than this raises (a dead or stuck rank)


# --- state sync and collectives (used by every rank) -------------------------------------------


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's state tensors in a fixed order (param group, parameter, sorted key); a
    MasterAdamW's are the entries this rank holds (its shard when sharded)."""
    if isinstance(optimizer, MasterAdamW):
        return [e[k] for _, e in sorted(optimizer.entries().items()) for k in sorted(e)]
    out: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            out.extend(state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor))
    return out


def optimizer_skeleton(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with each tensor replaced by its (shape, dtype): what a newcomer
    needs to allocate the state that the broadcast then fills."""
    sd = optimizer.state_dict()
    state = {
        idx: {
            k: ("tensor", tuple(v.shape), str(v.dtype).removeprefix("torch.")) if torch.is_tensor(v) else v
            for k, v in entry.items()
        }
        for idx, entry in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def load_skeleton(optimizer: torch.optim.Optimizer, skeleton: dict[str, Any]) -> None:
    """Allocate state shaped like rank 0's (values arrive by broadcast)."""
    state = {
        idx: {
            k: torch.empty(v[1], dtype=getattr(torch, v[2]))
            if isinstance(v, tuple) and v[:1] == ("tensor",)
            else v
            for k, v in entry.items()
        }
        for idx, entry in skeleton["state"].items()
    }
    optimizer.load_state_dict({"state": state, "param_groups": skeleton["param_groups"]})


def broadcast_from_rank0(pg: Any, tensors: list[torch.Tensor]) -> None:
    """Overwrite `tensors` on every rank with rank 0's values (one broadcast per dtype)."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    for flat, members in flat_by_dtype(tensors):
        pg.broadcast([flat], opts).wait()
        unflatten_into(flat, members)


def sync_replica(
    pg: Any,
    rank: int,
    model: Any,
    optimizer: Any,
    ref_model: Any | None,
    layout: dict[str, Any] | None = None,
) -> None:
    """Make this replica equal rank 0's: parameters, reference parameters, optimizer state. A
    MasterAdamW's state goes out as `MasterAdamW.send_state` says (each rank its shard when
    sharded); `layout` is rank 0's `MasterAdamW.layout()` on the receiving ranks."""
    tensors = list(model.parameters())
    if not isinstance(optimizer, MasterAdamW):
        tensors += optimizer_tensors(optimizer)
    if ref_model is not None:
        tensors += list(ref_model.parameters())
    broadcast_from_rank0(pg, tensors)
    if isinstance(optimizer, MasterAdamW):
        if rank == 0:
            optimizer.send_state()
        else:
            optimizer.receive_state(layout or {"template": {}})


def gradient_tensors(model: Any, optimizer: Any) -> list[torch.Tensor]:
    """The gradients a step uses, in parameter order: a MasterAdamW's (fp32 main gradients with
    masters), else every trainable parameter's own (a missing one allocated as zeros)."""
    if isinstance(optimizer, MasterAdamW):
        return optimizer.gradients()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params if p.grad is not None]


def allreduce_gradients(pg: Any, model: Any, optimizer: Any = None) -> None:
    """Sum every gradient of `gradient_tensors` over the group (a missing gradient counts as zeros)."""
    for flat, members in flat_by_dtype(gradient_tensors(model, optimizer)):
        pg.allreduce([flat]).wait()
        unflatten_into(flat, members)


def replica_digest(model: Any, optimizer: Any) -> str:
    """sha256 over the parameters and optimizer state (bitwise identity of replicas); with a sharded
    optimizer, over the parameters only (each rank holds a different shard of the state)."""
    h = hashlib.sha256()
    sharded = isinstance(optimizer, MasterAdamW) and optimizer.sharded
    for t in list(model.parameters()) + ([] if sharded else optimizer_tensors(optimizer)):
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer state this rank holds (MasterAdamW: masters included)."""
    return sum(t.numel() * t.element_size() for t in optimizer_tensors(optimizer))


def make_process_group(
    store: Any, generation: int, rank: int, size: int, backend: str, host: str = LOCAL_HOST
) -> Any:
    """A process group of generation `generation` (blocks until all `size` ranks have joined); gloo's
    transport on `host` (rendezvous.gloo_device)."""
    prefixed = dist.PrefixStore(f"gyre-dp/{generation}", store)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if backend == "nccl":  # scripts/gpu_check.sh runs this path on a GPU host
        nccl_options = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]
        nccl_options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, nccl_options)  # type: ignore[attr-defined]
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [gloo_device(host)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(prefixed, rank, size, options)


# --- the group, seen from rank 0 ---------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaSpec:
    """What a worker needs to build its replica: the trainer config (JSON) and the torch device."""

    trainer_config_json: str
    device: str
    backend: str


@dataclass
class _Worker:
    device_id: str
    device: str  # torch device of its replica
    process: multiprocessing.process.BaseProcess
    conn: Connection
    ready: bool = False

    def poll_ready(self, timeout: float | None = 0.0) -> bool:
        if not self.ready and self.conn.poll(timeout):
            _expect(self, "ready")
            self.ready = True
        return self.ready


def _expect(worker: _Worker, kind: str) -> Any:
    try:
        msg = worker.conn.recv()
    except EOFError as exc:
        raise RuntimeError(f"data-parallel worker pid {worker.process.pid} died") from exc
    if msg[0] == "error":
        raise RuntimeError(f"data-parallel worker pid {worker.process.pid} failed:\n{msg[1]}")
    if msg[0] != kind:
        raise RuntimeError(f"data-parallel worker sent {msg[0]!r}, expected {kind!r}")
    return msg[1] if len(msg) > 1 else None


class ResizableDPGroup:
    """The data-parallel group as rank 0 sees it: one rank per device, resized by `apply`.

    Not thread-safe: the trainer calls it only at micro-batch boundaries and inside a micro-batch
    (one thread at a time).
    """

    rank = 0

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        ref_model: Any | None,
        spec_of: Callable[[str], ReplicaSpec],
        move_rank0: Callable[[str | None], None] = lambda device_id: None,
        rendezvous: tuple[str, int] = (LOCAL_HOST, 0),
    ) -> None:
        """`spec_of(device_id)` -> the ReplicaSpec of a worker on that device; `move_rank0(device_id)`
        puts rank 0's replica on that device (None: park it off every leased device); `rendezvous`
        is the (host, port) of the store rank 0 hosts (rendezvous.store_address; port 0 = free)."""
        self.model, self.optimizer, self.ref_model = model, optimizer, ref_model
        self.spec_of, self.move_rank0 = spec_of, move_rank0
        self.rendezvous = rendezvous
        # apply (a boundary outside the step, or wait_devices_applied) and a checkpoint's shard writing
        # (SaveCheckpoint, stop) may run in two threads; both talk to the workers over their pipes
        self.pipes_lock = threading.RLock()
        self.store: Any = None
        self.ctx = multiprocessing.get_context("spawn")
        self.home: str | None = None  # rank 0's device
        self.members: list[_Worker] = []  # joined workers; rank = index + 1
        self.booting: list[_Worker] = []  # started, joining at a later boundary
        self.spares: list[_Worker] = []  # ready CPU workers out of the group, reused before spawning
        self.wanted: list[str] = []
        self.generation = 0
        self.pg: Any = None
        self.backend = "gloo"

    @property
    def size(self) -> int:
        """Ranks training now: 0 while no device is held (rank 0 parked)."""
        return 0 if self.home is None else 1 + len(self.members)

    @property
    def device_ids(self) -> list[str]:
        """Devices of the ranks, in rank order."""
        return ([self.home] if self.home else []) + [w.device_id for w in self.members]

    def request_devices(self, device_ids: list[str]) -> None:
        """One rank per device in `device_ids`; takes effect at the next `apply`."""
        self.wanted = list(dict.fromkeys(device_ids))

    def settled(self) -> bool:
        """The ranks are exactly the wanted devices (nothing to apply)."""
        return set(self.device_ids) == set(self.wanted) and not self.booting

    def apply(self, wait: bool = False) -> bool:
        """At a micro-batch boundary: move toward the wanted devices; True when the ranks changed.

        Leaving happens at once (leavers have exited on return). Joining takes workers that are
        ready; with `wait`, it first waits until every missing worker is ready.
        """
        with self.pipes_lock:
            return self._apply(wait)

    def _apply(self, wait: bool) -> bool:
        wanted = set(self.wanted)
        gathered = self._gather_if_resizing(wait)
        changed = False
        for w in [w for w in self.members + self.booting if w.device_id not in wanted]:
            self._retire(w)
            changed |= w in self.members
        self.members = [w for w in self.members if w.device_id in wanted]
        self.booting = [w for w in self.booting if w.device_id in wanted]
        if self.home not in wanted:
            new_home = next((d for d in self.wanted), None)
            for w in [w for w in self.members + self.booting if w.device_id == new_home]:
                self._retire(w)  # rank 0 takes this device over from its worker
            self.members = [w for w in self.members if w.device_id != new_home]
            self.booting = [w for w in self.booting if w.device_id != new_home]
            self.move_rank0(new_home)
            self.home, changed = new_home, True
        have = {w.device_id for w in self.members + self.booting} | {self.home}
        for device_id in self.wanted:
            if device_id not in have:
                self.booting.append(self._start(device_id))
        joining = [w for w in self.booting if w.poll_ready(None if wait else 0.0)]
        if joining:
            self.booting = [w for w in self.booting if w not in joining]
            self.members.extend(joining)
            changed = True
        if changed:
            self._new_generation()
        elif gathered and isinstance(self.optimizer, MasterAdamW):  # nothing moved: back to the old shard
            self.optimizer.set_group(self.pg, 0, self.size)
            self.optimizer.keep_own()
        return changed

    def _gather_if_resizing(self, wait: bool) -> bool:
        """Before the group may change: with a sharded optimizer, copy every rank's shard to rank 0
        (the new group's shards are cut from rank 0's whole state). Conservative: True when it
        gathered, which happens whenever a rank may leave or join in this `apply`."""
        if not (isinstance(self.optimizer, MasterAdamW) and self.optimizer.sharded and self.pg is not None):
            return False
        wanted = set(self.wanted)
        leaving = self.home not in wanted or any(w.device_id not in wanted for w in self.members)
        have = {w.device_id for w in self.members + self.booting} | {self.home}
        joining = any(w.poll_ready() for w in self.booting if w.device_id in wanted) or (
            wait and (bool(self.booting) or bool(wanted - have))
        )
        if not (leaving or joining):
            return False
        for w in self.members:
            w.conn.send(("gather",))
        self.optimizer.receive_shards()
        for w in self.members:
            _expect(w, "gathered")
        return True

    def gather_optimizer(self) -> None:
        """Rank 0 holds every optimizer entry until `release_optimizer` (a checkpoint of a sharded
        optimizer is written from it); a no-op for an optimizer that is not sharded."""
        if not (isinstance(self.optimizer, MasterAdamW) and self.optimizer.sharded and self.pg is not None):
            return
        size = self.size
        for w in self.members:
            w.conn.send(("gather",))
        self.optimizer.receive_shards()
        for w in self.members:
            _expect(w, "gathered")
        self.optimizer.set_group(self.pg, 0, size)

    def release_optimizer(self) -> None:
        """Rank 0 keeps only its own shard again (after `gather_optimizer`)."""
        if isinstance(self.optimizer, MasterAdamW) and self.optimizer.sharded and self.pg is not None:
            self.optimizer.keep_own()

    def _start(self, device_id: str) -> _Worker:
        if self.store is None:
            self.store = host_store(*self.rendezvous, COLLECTIVE_TIMEOUT_S)
        spec = self.spec_of(device_id)
        self.backend = spec.backend
        if spec.device == "cpu" and self.spares:
            ready = [w for w in self.spares if w.poll_ready()]
            worker = (ready or self.spares)[-1]  # a ready spare first, else one still booting
            self.spares.remove(worker)
            worker.device_id = device_id
            return worker
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=worker_main, args=(child, self.rendezvous[0], self.store.port, spec), daemon=True
        )
        proc.start()
        child.close()
        log.info("data-parallel worker for %s starting on %s (pid %s)", device_id, spec.device, proc.pid)
        return _Worker(device_id, spec.device, proc, parent)

    def _retire(self, worker: _Worker) -> None:
        """The worker leaves the group. A worker of a logical CPU slot stays as a spare, ready or
        still booting (its process holds no device; the next slot granted reuses it instead of
        paying a new process's start-up — under colocate the trainer holds the pool for less time
        than a worker takes to boot on a loaded CPU, so terminating booting workers meant no rank
        ever joined); any other worker exits — one still booting is terminated at once."""
        if worker.device == "cpu":
            self.spares.append(worker)
            return
        if not worker.ready:
            worker.process.terminate()
        self._exit(worker)

    def _exit(self, worker: _Worker) -> None:
        try:
            worker.conn.send(("leave",))
        except (BrokenPipeError, OSError):
            pass
        worker.process.join(30)
        if worker.process.is_alive():
            worker.process.terminate()
            worker.process.join()
        worker.conn.close()

    def _new_generation(self) -> None:
        self.generation += 1
        self.pg = None
        master = isinstance(self.optimizer, MasterAdamW)
        if master:
            self.optimizer.set_group(None, 0, 1)
        if self.size <= 1:
            log.info("data-parallel group generation %d: size %d", self.generation, self.size)
            return
        skeleton = self.optimizer.layout() if master else optimizer_skeleton(self.optimizer)
        for rank, w in enumerate(self.members, start=1):
            w.conn.send(("join", self.generation, rank, self.size, skeleton))
        self.pg = make_process_group(
            self.store, self.generation, 0, self.size, self.backend, self.rendezvous[0]
        )
        if master:
            self.optimizer.set_group(self.pg, 0, self.size)
        sync_replica(self.pg, 0, self.model, self.optimizer, self.ref_model)
        for w in self.members:
            _expect(w, "joined")
        log.info(
            "data-parallel group generation %d: size %d on %s", self.generation, self.size, self.device_ids
        )

    # -- one micro-batch, one step --

    def scatter(self, micro: PackedBatch) -> PackedBatch:
        """Rank 0's shard of a micro-batch; the other shards go to their ranks, which start at once."""
        if not self.members:
            return micro
        shards = micro.split(self.size)
        for w, s in zip(self.members, shards[1:], strict=True):
            w.conn.send(("micro", pickle.dumps(s)))
        return shards[0]

    def reduce_gradients(self, model: Any) -> None:
        if self.pg is not None:
            allreduce_gradients(self.pg, model, self.optimizer)

    def gather_metrics(self) -> list[dict[str, float]]:
        """The other ranks' metrics of the micro-batch (waits until each finished it)."""
        return [_expect(w, "metrics") for w in self.members]

    def finish_step(self) -> None:
        """Tell the other ranks to clip and step (rank 0 does the same on the same gradient)."""
        for w in self.members:
            w.conn.send(("finish",))

    def wait_finished(self) -> None:
        for w in self.members:
            _expect(w, "finished")

    def replica_digests(self) -> list[str]:
        """Digest of parameters + optimizer state of every rank, in rank order."""
        for w in self.members:
            w.conn.send(("digest",))
        return [replica_digest(self.model, self.optimizer)] + [_expect(w, "digest") for w in self.members]

    def save_optimizer(self, directory: Path) -> None:
        """Every rank writes its optimizer shard under `directory` at once (dist_checkpoint.py)."""
        with self.pipes_lock:
            self._save_optimizer(directory)

    def _save_optimizer(self, directory: Path) -> None:
        for w in self.members:
            w.conn.send(("save_optimizer", str(directory)))
        save_shard(directory, 0, self.model, self.optimizer)
        for w in self.members:
            _expect(w, "saved")

    def state_bytes(self) -> list[int]:
        """Bytes of optimizer state (with masters) that each rank holds, in rank order."""
        for w in self.members:
            w.conn.send(("state_bytes",))
        return [state_bytes(self.optimizer)] + [_expect(w, "state_bytes") for w in self.members]

    def worker_pids(self) -> list[int]:
        return [w.process.pid or 0 for w in self.members]

    def spare_pids(self) -> list[int]:
        return [w.process.pid or 0 for w in self.spares]

    def close(self) -> None:
        """Every worker process exits (members, booting ones and spares)."""
        for w in self.members + self.booting + self.spares:
            if not w.ready:
                w.process.terminate()
            self._exit(w)
        self.members, self.booting, self.spares, self.pg = [], [], [], None


# --- a worker process (ranks >= 1) -------------------------------------------------------------


def worker_main(conn: Connection, store_host: str, store_port: int, spec: ReplicaSpec) -> None:
    """Build a replica, then serve rank 0's commands until told to leave or the pipe closes."""
    try:
        from services.trainer.config import TrainerConfig
        from services.trainer.step import (
            backward_micro,
            build_replica,
            finish_step,
            loss_dtype,
            shard_loss_settings,
        )

        cfg = TrainerConfig.model_validate_json(spec.trainer_config_json)
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(spec.device))
        model, optimizer, ref_model, settings = build_replica(cfg, spec.device)
        settings = shard_loss_settings(settings)  # the step's weights arrive normalised
        store = join_store(store_host, store_port, COLLECTIVE_TIMEOUT_S)
        conn.send(("ready",))
        pg: Any = None
        rank = 0  # set by "join"
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return  # rank 0 is gone
            if msg[0] == "join":
                _, generation, rank, size, skeleton = msg
                master = isinstance(optimizer, MasterAdamW)
                if not master:
                    load_skeleton(optimizer, skeleton)
                pg = make_process_group(store, generation, rank, size, spec.backend, store_host)
                if master:
                    optimizer.set_group(pg, rank, size)
                sync_replica(pg, rank, model, optimizer, ref_model, skeleton if master else None)
                conn.send(("joined",))
            elif msg[0] == "gather":  # a sharded optimizer's state goes to rank 0 (a resize or checkpoint)
                if isinstance(optimizer, MasterAdamW):
                    optimizer.send_shard_to_rank0()
                conn.send(("gathered",))
            elif msg[0] == "micro":
                shard: PackedBatch = pickle.loads(msg[1])
                param = next(model.parameters())
                optimizer.zero_grad(set_to_none=False)  # rank 0 alone carries the step's sum so far
                shard = shard.to(param.device, loss_dtype(model, optimizer))
                metrics = backward_micro(model, shard, settings, ref_model)
                allreduce_gradients(pg, model, optimizer)
                conn.send(("metrics", metrics))
            elif msg[0] == "finish":
                finish_step(model, optimizer, cfg.grad_clip)
                conn.send(("finished",))
            elif msg[0] == "digest":
                conn.send(("digest", replica_digest(model, optimizer)))
            elif msg[0] == "save_optimizer":
                save_shard(Path(msg[1]), rank, model, optimizer)
                conn.send(("saved",))
            elif msg[0] == "state_bytes":
                conn.send(("state_bytes", state_bytes(optimizer)))
            elif msg[0] == "leave":
                return
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise
