"""Tensor parallelism inside elastic data parallelism: replicas of TP worker processes, resized whole.

With tensor parallel size TP, one data-parallel replica is TP processes (one per device), and the
devices held form floor(n / TP) replicas; a leftover device (n not a multiple of TP) waits, unused,
until more devices make a whole replica (`TensorParallelReplicas.waiting_devices`).

Two kinds of group, built differently on purpose:

    TP group   the processes of one replica. Each replica process initialises torch.distributed's
               *default* group over just its replica (world = TP, a TCPStore prefix of its own) and
               Megatron's parallel state on it (`gyre.model.parallel.init_model_parallel`): Megatron's
               state is global per process, and a replica's membership never changes (a resize adds
               or removes whole replicas), so that state is set once when the process starts and
               stays true for its life. Megatron's own data-parallel group inside it has size 1.
    DP group   per TP rank r, the TP-rank-r processes of every replica, rebuilt at each resize as a
               fresh gloo group of a new generation (`dp_group.make_process_group` on a
               `gyre-tp<r>/` store prefix), outside Megatron's state. Gradients of TP shard r are
               summed over it.

A step is the same sequence as `dp_group`'s (one rank's micro-batch shard per replica; both TP ranks
of a replica get the same shard): every replica zeroes its gradients at `begin_step`; at each
micro-batch the replicas other than DP rank 0 zero theirs, all backpropagate their shard and the DP
group sums, so after it every replica holds the step's gradient so far. A resize happens only between
micro-batches. DP rank 0 is always a replica that was already in the group (new ones are appended),
so the sum so far survives any resize that keeps at least one replica; a step needs one replica at
every boundary (the caller's: with no whole replica, `apply` raises rather than lose the gradient).

Guarantees
- After every resize, TP rank r of every replica holds the parameters, reference parameters and
  optimizer state of TP rank r of DP rank 0 bit for bit (one broadcast per dtype over DP group r):
  a new replica gets its TP shard of the state from the replica that holds it.
- The gradient norm that clipping uses is the whole model's: squares of split parameters' gradients
  summed over the TP group, replicated parameters' (equal on every TP rank) counted once.
- Summed over DP and TP, the step equals the one-process step over the same micro-batches up to float
  summation order (tests/trainer/test_elastic_tp_dp.py: float64, rtol 1e-6, with resizes).
- Optimizer: plain AdamW only (precision fp32, optimizer_sharding none); the constructor refuses the
  MasterAdamW paths, whose norms and shards are not TP-aware yet.
"""

from __future__ import annotations

import datetime
import logging
import math
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
from services.trainer.batch import PackedBatch
from services.trainer.config import TrainerConfig
from services.trainer.dp_group import (
    COLLECTIVE_TIMEOUT_S,
    _expect,
    _Worker,
    allreduce_gradients,
    load_skeleton,
    make_process_group,
    optimizer_skeleton,
    replica_digest,
    sync_replica,
)
from services.trainer.rendezvous import LOCAL_HOST, host_store, join_store

log = logging.getLogger(__name__)


def replicas_of(held: list[str], kept: list[tuple[str, ...]], tp_size: int) -> list[tuple[str, ...]]:
    """The replicas (device tuples of TP devices) for the devices `held`: every replica in `kept`
    whose devices are all still held, in their order, then new replicas from the remaining held
    devices in the order given; fewer than TP leftover devices form none (they wait)."""
    held_set = set(held)
    out = [r for r in kept if set(r) <= held_set]
    used = {d for r in out for d in r}
    free = [d for d in dict.fromkeys(held) if d not in used]
    for i in range(len(free) // tp_size):
        out.append(tuple(free[i * tp_size : (i + 1) * tp_size]))
    return out


def clip_tensor_parallel(model: Any, grad_clip: float, tp_group: Any) -> float:
    """Clip the gradients of this TP rank's shard to the whole model's norm `grad_clip` (0: no clip)
    and return the pre-clip norm (0.0 when not clipping), as `torch.nn.utils.clip_grad_norm_` does
    for the unsplit model: coefficient min(1, clip / (norm + 1e-6))."""
    if not grad_clip:
        return 0.0
    grads_split: list[torch.Tensor] = []
    grads_replicated: list[torch.Tensor] = []
    for p in model.parameters():
        if p.grad is None:
            continue
        (grads_split if getattr(p, "tensor_model_parallel", False) else grads_replicated).append(p.grad)
    zero = torch.zeros((), dtype=torch.float64)
    split_sq = sum((g.detach().double().pow(2).sum() for g in grads_split), zero)
    dist.all_reduce(split_sq, group=tp_group)
    replicated_sq = sum((g.detach().double().pow(2).sum() for g in grads_replicated), zero)
    norm = math.sqrt(float(split_sq + replicated_sq))
    coef = min(1.0, grad_clip / (norm + 1e-6))
    if coef < 1.0:
        with torch.no_grad():
            for g in grads_split + grads_replicated:
                g.mul_(coef)
    return norm


# The whole (TP = 1 shaped) state of a replica, by parameter name: "weights" (required), "optimizer"
# (AdamW state per parameter: step, exp_avg, exp_avg_sq; absent before the first step) and "grads"
# (the step's gradient so far; absent between steps).
FullState = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class TPReplicaSpec:
    """What one replica process needs: the trainer config (JSON), TP size and rank, and the replica's
    store prefix (its state arrives when it joins)."""

    trainer_config_json: str
    tp_size: int
    tp_rank: int
    replica_key: str


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
    ) -> None:
        if cfg.precision != "fp32" or cfg.optimizer_sharding != "none":
            raise InvalidArgument(
                "tensor parallel replicas train with plain AdamW only (precision fp32, optimizer_sharding "
                "none): MasterAdamW's clipping norm and ZeRO-1 shards are not TP-aware yet"
            )
        if cfg.device != "cpu":
            raise InvalidArgument("tensor parallel replicas run on CPU (gloo) so far")
        self.cfg, self.tp_size, self.seed, self.keep = cfg, tp_size, seed, keep
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
        targets = replicas_of(self.wanted, [r.devices for r in self.replicas], self.tp_size)
        return [r.devices for r in self.replicas] == targets and not self.booting

    @property
    def waiting_devices(self) -> list[str]:
        """Held devices that make no whole replica (fewer than TP left over): unused until more come."""
        used = {
            d for r in replicas_of(self.wanted, [r.devices for r in self.replicas], self.tp_size) for d in r
        }
        return [d for d in self.wanted if d not in used]

    def request_devices(self, device_ids: list[str]) -> None:
        """floor(len / TP) replicas over `device_ids`; takes effect at the next `apply`."""
        self.wanted = list(dict.fromkeys(device_ids))

    def apply(self, wait: bool = False) -> bool:
        """At a micro-batch boundary: replicas whose devices are released leave (their processes
        exit), replicas whose processes are ready join (with `wait`, after waiting for them); True
        when the group changed. When no replica stays, the state goes to `keep` first."""
        targets = replicas_of(self.wanted, [r.devices for r in self.replicas], self.tp_size)
        leaving = [r for r in self.replicas + self.booting if r.devices not in targets]
        staying = [r for r in self.replicas if r.devices in targets]
        if self.replicas and not staying:  # the last replicas leave: their state is kept outside
            self.keep(self.full_state())
        for r in leaving:
            self._exit(r)
        self.booting = [r for r in self.booting if r.devices in targets]
        have = {r.devices for r in staying + self.booting}
        self.booting += [self._start(devices) for devices in targets if devices not in have]
        joining = [r for r in self.booting if r.ready(wait)]
        self.booting = [r for r in self.booting if r not in joining]
        changed = bool(joining) or len(staying) != len(self.replicas)
        self.replicas = staying + joining
        if changed:
            self._new_generation(joining)
        return changed

    def _start(self, devices: tuple[str, ...]) -> _Replica:
        if self.store is None:
            self.store = host_store(*self.rendezvous, COLLECTIVE_TIMEOUT_S)
        key = f"replica{self.started}"
        self.started += 1
        replica = _Replica(devices)
        for tp_rank, device_id in enumerate(devices):
            spec = TPReplicaSpec(self.cfg.model_dump_json(), self.tp_size, tp_rank, key)
            parent, child = self.ctx.Pipe()
            proc = self.ctx.Process(
                target=tp_worker_main, args=(child, self.rendezvous[0], self.store.port, spec), daemon=True
            )
            proc.start()
            child.close()
            replica.ranks.append(_Worker(device_id, "cpu", proc, parent))
        log.info("tensor-parallel replica on %s starting", devices)
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
        skeletons: list[Any] = [None] * self.tp_size
        if not fresh:
            for w in source.ranks:
                w.conn.send(("skeleton",))
            skeletons = [_expect(w, "skeleton") for w in source.ranks]
        for dp_rank, replica in enumerate(self.replicas):
            for tp_rank, w in enumerate(replica.ranks):
                skeleton = skeletons[tp_rank] if replica in joining else None
                w.conn.send(("join", self.generation, dp_rank, self.size, skeleton, seed))
        for replica in self.replicas:
            for w in replica.ranks:
                _expect(w, "joined")
        log.info(
            "tensor-parallel DP generation %d: %d replicas of TP %d", self.generation, self.size, self.tp_size
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
        """One micro-batch: shard r (whole trees) to replica r, backward, DP all-reduce; the metrics of
        each replica's TP rank 0. `grad_factor` first rescales the gradient accumulated so far
        (trainer.streaming's StepNormaliser)."""
        if not self.replicas:
            raise InvalidArgument("no replica: hold at least TP devices")
        shards = micro.split(self.size)
        for replica, shard in zip(self.replicas, shards, strict=True):
            payload = pickle.dumps(shard)
            for w in replica.ranks:
                w.conn.send(("micro", payload, grad_factor))
        return [[_expect(w, "metrics") for w in r.ranks][0] for r in self.replicas]

    def finish_step(self) -> float:
        """Every rank clips (the whole model's norm) and steps; the pre-clip norm (0: no clip)."""
        return float(self._all(("finish",), "finished")[0])

    def full_state(self) -> FullState:
        """DP rank 0's parameters, AdamW state and gradients gathered to full (TP = 1) shapes
        (`gyre.model.tp_shard.gather_full`)."""
        for w in self.replicas[0].ranks:
            w.conn.send(("full_state",))
        state: FullState = [_expect(w, "full_state") for w in self.replicas[0].ranks][0]
        return state

    def full_weights_now(self) -> dict[str, torch.Tensor]:
        """DP rank 0's parameters gathered to full (TP = 1) shapes."""
        return dict(self.full_state()["weights"])

    def replica_digests(self) -> list[list[str]]:
        """Per replica (DP rank order), the digest of each TP rank's parameters and optimizer state."""
        digests = self._all(("digest",), "digest")
        return [digests[i * self.tp_size : (i + 1) * self.tp_size] for i in range(self.size)]

    def worker_pids(self) -> list[int]:
        return [w.process.pid or 0 for r in self.replicas + self.booting for w in r.ranks]

    def close(self) -> None:
        """Every replica process exits."""
        for r in self.replicas + self.booting:
            self._exit(r)
        self.replicas, self.booting = [], []


def _gather_state(model: Any, optimizer: Any, params: dict[str, Any], gather_full: Any) -> FullState:
    """This TP rank's parameters, AdamW state and gradients gathered to full shapes (collective over
    the TP group: every TP rank calls it, with state for the same parameters)."""
    weights = gather_full(model, {n: p.detach() for n, p in params.items()})
    grads = gather_full(
        model, {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params.items()}
    )
    opt: dict[str, Any] = {}
    for name, p in params.items():
        entry = optimizer.state.get(p, {})
        if not entry:
            continue
        opt[name] = {}
        for k in sorted(entry):
            v = entry[k]
            if torch.is_tensor(v) and v.shape == p.shape:
                opt[name][k] = gather_full(model, {name: v})[name].clone()
            else:
                opt[name][k] = v.clone() if torch.is_tensor(v) else v
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
            rank=spec.tp_rank,
            world_size=spec.tp_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        layout = init_model_parallel(spec.tp_size, 1)
        model, optimizer, ref_model, settings = build_replica(cfg, "cpu")
        settings = shard_loss_settings(settings)
        params = dict(model.named_parameters())

        def load_seed(seed: FullState) -> None:
            load_full_weights(model, seed["weights"])
            if ref_model is not None:
                load_full_weights(ref_model, seed.get("reference", seed["weights"]))
            optimizer.state.clear()
            for name, entry in seed.get("optimizer", {}).items():
                optimizer.state[params[name]] = {
                    k: shard_of(model, name, v, spec.tp_size, spec.tp_rank).clone()
                    if torch.is_tensor(v) and v.shape == seed["weights"][name].shape
                    else (v.clone() if torch.is_tensor(v) else v)
                    for k, v in entry.items()
                }
            grads = seed.get("grads", {})
            for name, p in params.items():
                full_grad = grads.get(name)
                p.grad = (
                    None
                    if full_grad is None
                    else shard_of(model, name, full_grad, spec.tp_size, spec.tp_rank).clone()
                )

        dp_store = dist.PrefixStore(f"gyre-tp{spec.tp_rank}", store)
        conn.send(("ready",))
        pg: Any = None
        dp_rank = 0
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg[0] == "skeleton":
                conn.send(("skeleton", optimizer_skeleton(optimizer)))
            elif msg[0] == "join":
                _, generation, dp_rank, dp_size, skeleton, seed = msg
                if seed is not None:
                    load_seed(seed)
                elif skeleton is not None:
                    load_skeleton(optimizer, skeleton)
                pg = None
                if dp_size > 1:
                    pg = make_process_group(dp_store, generation, dp_rank, dp_size, "gloo", store_host)
                    sync_replica(pg, dp_rank, model, optimizer, ref_model)
                conn.send(("joined",))
            elif msg[0] == "begin":
                optimizer.zero_grad(set_to_none=False)
                conn.send(("begun",))
            elif msg[0] == "micro":
                shard: PackedBatch = pickle.loads(msg[1])
                if msg[2] != 1.0:
                    with torch.no_grad():
                        for p in params.values():
                            if p.grad is not None:
                                p.grad.mul_(msg[2])
                if dp_rank != 0:
                    optimizer.zero_grad(set_to_none=False)  # DP rank 0 alone carries the sum so far
                metrics = backward_micro(
                    model, shard.to("cpu", loss_dtype(model, optimizer)), settings, ref_model
                )
                if pg is not None:
                    allreduce_gradients(pg, model, optimizer)
                conn.send(("metrics", metrics))
            elif msg[0] == "finish":
                norm = clip_tensor_parallel(model, cfg.grad_clip, layout.tp_group)
                optimizer.step()
                conn.send(("finished", norm))
            elif msg[0] == "full_state":
                conn.send(("full_state", _gather_state(model, optimizer, params, gather_full)))
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
