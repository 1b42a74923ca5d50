"""Model parallelism inside elastic data parallelism: replicas of TP x CP worker processes, resized whole.

With tensor parallel size TP and context parallel size CP, one data-parallel replica is TP x CP
processes (one per device), and the devices held form floor(n / (TP x CP)) replicas; leftover devices
wait, unused, until more devices make a whole replica (`TensorParallelReplicas.waiting_devices`).
Inside a replica, process i is TP rank i % TP and CP rank i // TP (Megatron's tp-cp order).

Two kinds of group, built differently on purpose:

    TP and CP  the processes of one replica. Each replica process initialises torch.distributed's
    groups    *default* group over just its replica (world = TP x CP, a TCPStore prefix of its own)
               and Megatron's parallel state on it (`gyre.model.parallel.init_model_parallel(TP, CP)`),
               which gives its TP group and its CP group: Megatron's state is global per process, and
               a replica's membership never changes (a resize adds or removes whole replicas), so that
               state is set once when the process starts and stays true for its life. Megatron's own
               data-parallel group inside it has size 1.
    DP group   per (TP rank r, CP rank c) position, the processes at that position in every replica,
               rebuilt at each resize as a fresh gloo group of a new generation
               (`dp_group.make_process_group` on a `gyre-tp<r>-cp<c>/` store prefix), outside
               Megatron's state. Gradients of TP shard r are summed over it.

A step is the same sequence as `dp_group`'s (one micro-batch shard of whole trees per replica; every
process of a replica gets the same shard, and each CP rank trains the loss terms of the tokens of its
contiguous slice, `gyre.model.parallel.cp_token_range`, exactly as the model-level CP does). Every
process zeroes its gradients at `begin_step`; the step's gradient so far is carried by one process per
TP rank, CP rank 0 of DP rank 0: at each micro-batch every other process zeroes its gradients, all
backpropagate, the CP group sums (`allreduce_over_context_parallel`) and then each DP group sums, so
after it every process holds the step's gradient so far for its TP shard. A resize happens only
between micro-batches. DP rank 0 is always a replica that was already in the group (new ones are
appended), so the sum so far survives any resize that keeps at least one replica; a step needs one
replica at every boundary (the caller's: with no whole replica, `apply` raises rather than lose the
gradient).

Guarantees
- After every resize, each (TP rank, CP rank) position of every replica holds the parameters,
  reference parameters and optimizer state of that position of DP rank 0 bit for bit (one broadcast
  per dtype over its DP group): a new replica is seeded position by position from the replica that
  holds the state. The CP ranks of a replica hold equal parameters and state (equal gradients after
  the CP sum, the same step).
- The gradient norm that clipping uses is the whole model's: squares of split parameters' gradients
  summed over the TP group, replicated parameters' (equal on every TP rank) counted once.
- Summed over DP, CP and TP, the step equals the one-process step over the same micro-batches up to
  float summation order (float64, rtol 1e-6, with resizes: tests/trainer/test_elastic_tp_dp.py for
  TP = 2, tests/trainer/test_elastic_cp_dp.py for CP = 2). The metrics of each replica's TP rank 0
  of every CP rank count the tokens that CP rank owns; added up they are the micro-batch's.
- Optimizer: plain AdamW, or a MasterAdamW (bf16 masters and/or ZeRO-1) whose clipping norm spans the
  TP group (`MasterAdamW.set_tensor_parallel`) and whose shards are each TP rank's own parameters over
  its position's DP group. With ZeRO-1, before a resize that changes the group every position's shards
  are gathered (point to point) onto the first staying replica, which becomes DP rank 0 and re-shards
  over the new group; `full_state` gathers them onto DP rank 0 and gives them back. TP = 2 with zero1
  equals TP = 2 with plain AdamW bit for bit under the same resizes (tests/trainer/test_tp_master_adamw.py).
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from gyre.errors import InvalidArgument
from services.trainer import named_state
from services.trainer.batch import PackedBatch
from services.trainer.collectives import flat_by_dtype, unflatten_into
from services.trainer.config import TrainerConfig
from services.trainer.dp_group import (
    COLLECTIVE_TIMEOUT_S,
    _expect,
    _Worker,
    allreduce_gradients,
    gradient_tensors,
    load_skeleton,
    make_process_group,
    optimizer_skeleton,
    replica_digest,
    sync_replica,
)
from services.trainer.grad_clip import clip_over_tensor_parallel, is_split
from services.trainer.rendezvous import LOCAL_HOST, host_store, join_store
from services.trainer.sharded_optimizer import MasterAdamW

log = logging.getLogger(__name__)


def replicas_of(held: list[str], kept: list[tuple[str, ...]], replica_size: int) -> list[tuple[str, ...]]:
    """The replicas (device tuples of `replica_size` = TP x CP devices) for the devices `held`: every
    replica in `kept` whose devices are all still held, in their order, then new replicas from the
    remaining held devices in the order given; fewer leftover devices than a replica form none (they
    wait)."""
    held_set = set(held)
    out = [r for r in kept if set(r) <= held_set]
    used = {d for r in out for d in r}
    free = [d for d in dict.fromkeys(held) if d not in used]
    for i in range(len(free) // replica_size):
        out.append(tuple(free[i * replica_size : (i + 1) * replica_size]))
    return out


def clip_tensor_parallel(model: Any, grad_clip: float, tp_group: Any) -> float:
    """Clip the gradients of this TP rank's shard to the whole model's norm `grad_clip` (0: no clip)
    and return the pre-clip norm (0.0 when not clipping), as `torch.nn.utils.clip_grad_norm_` does
    for the unsplit model (`grad_clip.clip_over_tensor_parallel`)."""
    params = [p for p in model.parameters() if p.grad is not None]
    split = [p.grad for p in params if is_split(p) and p.grad is not None]
    replicated = [p.grad for p in params if not is_split(p) and p.grad is not None]
    return clip_over_tensor_parallel(split, replicated, grad_clip, tp_group)


def allreduce_over_context_parallel(model: Any, optimizer: Any, cp_group: Any) -> None:
    """Sum the step's gradients (`dp_group.gradient_tensors`: a MasterAdamW's fp32 main gradients,
    else the parameters') over the replica's CP group, one flat all-reduce per dtype: each CP rank
    backpropagated the loss terms of the tokens it owns, so after it every CP rank holds the
    micro-batch's whole gradient (plus the sum so far, which only CP rank 0 carries in)."""
    for flat, members in flat_by_dtype(gradient_tensors(model, optimizer)):
        dist.all_reduce(flat, group=cp_group)
        unflatten_into(flat, members)


# The whole (TP = 1 shaped) state of a replica, by parameter name: "weights" (required), "optimizer"
# (AdamW state per parameter: step, exp_avg, exp_avg_sq; absent before the first step) and "grads"
# (the step's gradient so far; absent between steps).
FullState = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class TPReplicaSpec:
    """What one replica process needs: the trainer config (JSON), TP and CP sizes and ranks, and the
    replica's store prefix (its state arrives when it joins). Its rank inside the replica is
    tp_rank + tp_size * cp_rank (Megatron's tp-cp order: the TP ranks of a CP rank are consecutive)."""

    trainer_config_json: str
    tp_size: int
    tp_rank: int
    replica_key: str
    cp_size: int = 1
    cp_rank: int = 0

    @property
    def replica_rank(self) -> int:
        return self.tp_rank + self.tp_size * self.cp_rank


@dataclass
class _Replica:
    devices: tuple[str, ...]
    ranks: list[_Worker] = field(default_factory=list)  # TP rank order

    def ready(self, wait: bool) -> bool:
        return all(w.poll_ready(None if wait else 0.0) for w in self.ranks)


class TensorParallelReplicas:
    """Elastic DP over replicas of TP processes, driven from a coordinator that holds no replica.

    The state lives in the replicas while at least one trains. When a group forms from none, its
    replicas start from `seed()` (a FullState: each TP rank cuts its shards, `shard_of`); when the
    last replica leaves, even mid-step, the whole state — the step's gradient so far included — is
    gathered to full shapes and handed to `keep` first, so a later group resumes the step exactly.

    Not thread-safe; call it at micro-batch boundaries (`apply`) and between them (`micro`)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        tp_size: int,
        seed: Callable[[], FullState],
        keep: Callable[[FullState], None],
        rendezvous: tuple[str, int] = (LOCAL_HOST, 0),
        cp_size: int = 1,
    ) -> None:
        if cfg.device != "cpu":
            raise InvalidArgument("tensor parallel replicas run on CPU (gloo) so far")
        self.cfg, self.tp_size, self.seed, self.keep = cfg, tp_size, seed, keep
        self.cp_size = cp_size
        self.master = cfg.precision == "bf16" or cfg.optimizer_sharding == "zero1"  # a MasterAdamW
        self.sharded = cfg.optimizer_sharding == "zero1"
        self.replica_size = tp_size * cp_size  # processes (devices) per replica
        self.rendezvous = rendezvous
        self.store: Any = None
        self.ctx = multiprocessing.get_context("spawn")
        self.replicas: list[_Replica] = []  # in the group, DP rank order
        self.booting: list[_Replica] = []
        self.wanted: list[str] = []
        self.generation = 0
        self.started = 0  # replicas started so far (each gets its own store prefix)

    @property
    def size(self) -> int:
        """Replicas training now (the DP size)."""
        return len(self.replicas)

    @property
    def device_ids(self) -> list[str]:
        """Devices of the replicas training now, in DP then TP rank order."""
        return [d for r in self.replicas for d in r.devices]

    def settled(self) -> bool:
        """The replicas are exactly those the wanted devices form (nothing to apply)."""
        targets = replicas_of(self.wanted, [r.devices for r in self.replicas], self.replica_size)
        return [r.devices for r in self.replicas] == targets and not self.booting

    @property
    def waiting_devices(self) -> list[str]:
        """Held devices that make no whole replica (fewer than TP left over): unused until more come."""
        used = {
            d
            for r in replicas_of(self.wanted, [r.devices for r in self.replicas], self.replica_size)
            for d in r
        }
        return [d for d in self.wanted if d not in used]

    def request_devices(self, device_ids: list[str]) -> None:
        """floor(len / TP) replicas over `device_ids`; takes effect at the next `apply`."""
        self.wanted = list(dict.fromkeys(device_ids))

    def apply(self, wait: bool = False) -> bool:
        """At a micro-batch boundary: replicas whose devices are released leave (their processes
        exit), replicas whose processes are ready join (with `wait`, after waiting for them); True
        when the group changed. When no replica stays, the state goes to `keep` first."""
        targets = replicas_of(self.wanted, [r.devices for r in self.replicas], self.replica_size)
        staying = [r for r in self.replicas if r.devices in targets]
        leaving = [r for r in self.replicas + self.booting if r.devices not in targets]
        booting = [r for r in self.booting if r.devices in targets]
        have = {r.devices for r in staying + booting}
        new = [devices for devices in targets if devices not in have]
        joining = [r for r in booting if r.ready(wait)]
        will_change = bool(joining) or len(staying) != len(self.replicas) or (wait and bool(new))
        root: int | None = None  # the old DP rank that gathered a ZeRO-1 state (the new DP rank 0)
        if self.replicas and not staying:  # the last replicas leave: their state is kept outside
            self.keep(self.full_state())
        elif will_change and self.sharded and self.size > 1:
            root = self.replicas.index(staying[0])
            self._all(("gather", root), "gathered")
        for r in leaving:
            self._exit(r)
        started = [self._start(devices) for devices in new]
        if wait:  # without waiting, a replica started now joins at a later boundary
            joining += [r for r in started if r.ready(True)]
        self.booting = [r for r in booting + started if r not in joining]
        changed = bool(joining) or len(staying) != len(self.replicas)
        self.replicas = staying + joining
        if changed:
            self._new_generation(joining)
        elif root is not None:  # nothing moved after all: the gathering rank keeps its own shard again
            for w in self.replicas[root].ranks:
                w.conn.send(("regroup",))
            for w in self.replicas[root].ranks:
                _expect(w, "regrouped")
        return changed

    def _start(self, devices: tuple[str, ...]) -> _Replica:
        if self.store is None:
            self.store = host_store(*self.rendezvous, COLLECTIVE_TIMEOUT_S)
        key = f"replica{self.started}"
        self.started += 1
        replica = _Replica(devices)
        for local, device_id in enumerate(devices):
            tp_rank, cp_rank = local % self.tp_size, local // self.tp_size
            spec = TPReplicaSpec(
                self.cfg.model_dump_json(), self.tp_size, tp_rank, key, self.cp_size, cp_rank
            )
            parent, child = self.ctx.Pipe()
            proc = self.ctx.Process(
                target=tp_worker_main, args=(child, self.rendezvous[0], self.store.port, spec), daemon=True
            )
            proc.start()
            child.close()
            replica.ranks.append(_Worker(device_id, "cpu", proc, parent))
        log.info("model-parallel replica (TP %d x CP %d) on %s starting", self.tp_size, self.cp_size, devices)
        return replica

    def _exit(self, replica: _Replica) -> None:
        for w in replica.ranks:
            try:
                w.conn.send(("leave",))
            except (BrokenPipeError, OSError):
                pass
        for w in replica.ranks:
            w.process.join(30)
            if w.process.is_alive():
                w.process.terminate()
                w.process.join()
            w.conn.close()

    def _new_generation(self, joining: list[_Replica]) -> None:
        self.generation += 1
        if not self.replicas:
            return
        source = self.replicas[0]
        fresh = source in joining  # no replica held the state: every one starts from the seed
        seed = self.seed() if fresh else None
        skeletons: list[Any] = [None] * self.replica_size
        if not fresh:
            for w in source.ranks:
                w.conn.send(("skeleton",))
            skeletons = [_expect(w, "skeleton") for w in source.ranks]
        for dp_rank, replica in enumerate(self.replicas):
            for local, w in enumerate(replica.ranks):
                # a MasterAdamW's layout goes to every rank (each receives a new shard)
                skeleton = skeletons[local] if replica in joining or self.master else None
                w.conn.send(("join", self.generation, dp_rank, self.size, skeleton, seed))
        for replica in self.replicas:
            for w in replica.ranks:
                _expect(w, "joined")
        log.info(
            "model-parallel DP generation %d: %d replicas of TP %d x CP %d",
            self.generation,
            self.size,
            self.tp_size,
            self.cp_size,
        )

    def _all(self, msg: tuple[Any, ...], reply: str) -> list[Any]:
        for replica in self.replicas:
            for w in replica.ranks:
                w.conn.send(msg)
        return [_expect(w, reply) for replica in self.replicas for w in replica.ranks]

    def begin_step(self) -> None:
        """Every replica zeroes its gradients (the step's micro-batches accumulate into them)."""
        self._all(("begin",), "begun")

    def micro(self, micro: PackedBatch, grad_factor: float = 1.0) -> list[dict[str, float]]:
        """One micro-batch: shard r (whole trees) to every process of replica r (each CP rank trains
        the tokens of its slice), backward, CP then DP all-reduce; the metrics of each replica's TP
        rank 0 of every CP rank (each counts the tokens its CP rank owns: `combine_metrics` adds them
        up). `grad_factor` first rescales the gradient accumulated so far (trainer.streaming's
        StepNormaliser)."""
        if not self.replicas:
            raise InvalidArgument("no replica: hold at least TP devices")
        shards = micro.split(self.size)
        for replica, shard in zip(self.replicas, shards, strict=True):
            payload = pickle.dumps(shard)
            for w in replica.ranks:
                w.conn.send(("micro", payload, grad_factor))
        got = [[_expect(w, "metrics") for w in r.ranks] for r in self.replicas]
        return [m for per_replica in got for local, m in enumerate(per_replica) if local % self.tp_size == 0]

    def finish_step(self) -> float:
        """Every rank clips (the whole model's norm) and steps; the pre-clip norm (0: no clip)."""
        return float(self._all(("finish",), "finished")[0])

    def full_state(self, optimizer: bool = True) -> FullState:
        """DP rank 0's parameters, optimizer state and gradients gathered to full (TP = 1) shapes
        (`gyre.model.tp_shard.gather_full`); a ZeRO-1 state is first gathered over each DP group to
        DP rank 0, which then keeps only its own shard again. Every replica takes part. Without
        `optimizer`: the parameters only (gradients and optimizer state empty), which moves a
        quarter of the bytes (fp32 AdamW) and gathers no ZeRO-1 shard."""
        state: FullState = self._all(("full_state", optimizer), "full_state")[0]
        return state

    def full_weights_now(self) -> dict[str, torch.Tensor]:
        """DP rank 0's parameters gathered to full (TP = 1) shapes."""
        return dict(self.full_state(optimizer=False)["weights"])

    def replica_digests(self) -> list[list[str]]:
        """Per replica (DP rank order), the digest of each process's parameters and optimizer state
        (replica rank order: tp_rank + TP x cp_rank)."""
        digests = self._all(("digest",), "digest")
        n = self.replica_size
        return [digests[i * n : (i + 1) * n] for i in range(self.size)]

    def worker_pids(self) -> list[int]:
        return [w.process.pid or 0 for r in self.replicas + self.booting for w in r.ranks]

    def close(self) -> None:
        """Every replica process exits."""
        for r in self.replicas + self.booting:
            self._exit(r)
        self.replicas, self.booting = [], []


def _gather_state(model: Any, optimizer: Any, gather_full: Any, with_optimizer: bool = True) -> FullState:
    """This TP rank's parameters, optimizer state (`named_state.optimizer_state`: a MasterAdamW's
    masters included; every entry must be here) and gradients gathered to full shapes (collective
    over the TP group: every TP rank calls it, with state for the same parameters); without
    `with_optimizer` the parameters only."""
    params = dict(model.named_parameters())
    weights = gather_full(model, {n: p.detach() for n, p in params.items()})
    if not with_optimizer:
        return {"weights": {n: t.clone() for n, t in weights.items()}, "grads": {}, "optimizer": {}}
    grads = gather_full(model, named_state.gradients(model, optimizer))
    opt: dict[str, Any] = {}
    for name, entry in named_state.optimizer_state(model, optimizer).items():
        opt[name] = {}
        for k in sorted(entry):
            v = entry[k]
            if torch.is_tensor(v) and v.shape == params[name].shape:
                opt[name][k] = gather_full(model, {name: v})[name].clone()
            else:
                opt[name][k] = v
    return {
        "weights": {n: t.clone() for n, t in weights.items()},
        "grads": {n: t.clone() for n, t in grads.items()},
        "optimizer": opt,
    }


def tp_worker_main(conn: Connection, store_host: str, store_port: int, spec: TPReplicaSpec) -> None:
    """One TP rank of one replica: the replica's default group and Megatron state, the model shard,
    then the coordinator's commands until told to leave or the pipe closes."""
    try:
        from gyre.model.parallel import init_model_parallel
        from gyre.model.tp_shard import gather_full, load_full_weights, shard_of
        from services.trainer.step import backward_micro, build_replica, loss_dtype, shard_loss_settings

        torch.set_num_threads(1)
        cfg = TrainerConfig.model_validate_json(spec.trainer_config_json)
        store = join_store(store_host, store_port, COLLECTIVE_TIMEOUT_S)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"gyre-tp-replica/{spec.replica_key}", store),
            rank=spec.replica_rank,
            world_size=spec.tp_size * spec.cp_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        layout = init_model_parallel(spec.tp_size, spec.cp_size)
        if (layout.tp_rank, layout.cp_rank) != (spec.tp_rank, spec.cp_rank):
            raise RuntimeError(f"Megatron placed {spec} at TP {layout.tp_rank}, CP {layout.cp_rank}")
        model, optimizer, ref_model, settings = build_replica(cfg, "cpu")
        settings = shard_loss_settings(settings)

        master = isinstance(optimizer, MasterAdamW)
        if master:
            optimizer.set_tensor_parallel(layout.tp_group)

        def cut(name: str, full: torch.Tensor) -> torch.Tensor:
            return shard_of(model, name, full, spec.tp_size, spec.tp_rank)  # type: ignore[no-any-return]

        def load_seed(seed: FullState) -> None:
            load_full_weights(model, seed["weights"])
            if ref_model is not None:
                load_full_weights(ref_model, seed.get("reference", seed["weights"]))
            named_state.load_optimizer_state(
                model, optimizer, seed.get("optimizer", {}), seed["weights"], cut
            )
            named_state.load_gradients(model, optimizer, seed.get("grads", {}), cut)

        # one DP group per (TP rank, CP rank) position, rebuilt at every resize
        dp_store = dist.PrefixStore(f"gyre-tp{spec.tp_rank}-cp{spec.cp_rank}", store)
        # the step's gradient so far lives on one process per TP rank: DP rank 0, CP rank 0 (the
        # CP sum would otherwise count it CP times); every other process adds only its micro-batch
        conn.send(("ready",))
        pg: Any = None
        dp_rank, dp_size = 0, 1
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg[0] == "skeleton":
                conn.send(("skeleton", optimizer.layout() if master else optimizer_skeleton(optimizer)))
            elif msg[0] == "join":
                _, generation, dp_rank, dp_size, skeleton, seed = msg
                if seed is not None:
                    load_seed(seed)
                elif skeleton is not None and not master:
                    load_skeleton(optimizer, skeleton)
                pg = None
                if master:  # DP rank 0 holds every entry here (seeded, gathered, or alone before)
                    optimizer.set_group(None, 0, 1)
                if dp_size > 1:
                    pg = make_process_group(dp_store, generation, dp_rank, dp_size, "gloo", store_host)
                    if master:
                        optimizer.set_group(pg, dp_rank, dp_size)
                    layout_msg = (skeleton or optimizer.layout()) if master else None
                    sync_replica(pg, dp_rank, model, optimizer, ref_model, layout_msg)
                conn.send(("joined",))
            elif msg[0] == "gather":  # a ZeRO-1 state goes to one DP rank before the group changes
                if master and optimizer.sharded and pg is not None:
                    if dp_rank == msg[1]:
                        optimizer.receive_shards()
                    else:
                        optimizer.send_shard_to_rank0(msg[1])
                conn.send(("gathered",))
            elif msg[0] == "regroup":  # the gather changed nothing: keep the old group and shard
                optimizer.set_group(pg, dp_rank, dp_size)
                optimizer.keep_own()
                conn.send(("regrouped",))
            elif msg[0] == "begin":
                optimizer.zero_grad(set_to_none=False)
                conn.send(("begun",))
            elif msg[0] == "micro":
                shard: PackedBatch = pickle.loads(msg[1])
                if msg[2] != 1.0:
                    with torch.no_grad():
                        for g in gradient_tensors(model, optimizer):
                            g.mul_(msg[2])
                if dp_rank != 0 or spec.cp_rank != 0:
                    optimizer.zero_grad(set_to_none=False)  # one process per TP rank carries the sum
                metrics = backward_micro(
                    model, shard.to("cpu", loss_dtype(model, optimizer)), settings, ref_model
                )
                if spec.cp_size > 1:
                    allreduce_over_context_parallel(model, optimizer, layout.cp_group)
                if pg is not None:
                    allreduce_gradients(pg, model, optimizer)
                conn.send(("metrics", metrics))
            elif msg[0] == "finish":
                if master:
                    norm = optimizer.step_and_clip(cfg.grad_clip)
                else:
                    norm = clip_tensor_parallel(model, cfg.grad_clip, layout.tp_group)
                    optimizer.step()
                conn.send(("finished", norm))
            elif msg[0] == "full_state":
                with_optimizer = bool(msg[1])
                zero1 = with_optimizer and master and optimizer.sharded and pg is not None
                if zero1 and dp_rank != 0:
                    optimizer.send_shard_to_rank0()
                elif zero1:
                    optimizer.receive_shards()
                state = _gather_state(model, optimizer, gather_full, with_optimizer) if dp_rank == 0 else None
                if zero1 and dp_rank == 0:
                    optimizer.set_group(pg, 0, dp_size)
                    optimizer.keep_own()
                conn.send(("full_state", state))
            elif msg[0] == "digest":
                conn.send(("digest", replica_digest(model, optimizer)))
            elif msg[0] == "leave":
                return
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise
