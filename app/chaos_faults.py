"""The faults `gyre chaos` injects into a running deployment, one at a time, and how each is judged
recovered (app.chaos runs the job and counts the losses). `gyre chaos --soak` (app.chaos_soak) makes
its many kills with the same `kill_target`, `inject_engine_fault` and `engine_recovered`.

    for each fault, in order:
        wait for trainer step `at_step` + a random delay (seeded); a rollout or engine kill then also
        waits for live executions (an engine kill: for a torch engine holding requests)
        inject it                                                      -> injected_at, step_at_kill
        wait until it is recovered (per target, below)                 -> recovery_s
        wait until the trainer publishes its next weight version       -> progress_resumed_s

Targets and what "recovered" means:

    scheduler, rollout, trajectory, trainer   SIGKILL the service's process; the supervisor restarted
                                              it and every service reports SERVING
    nats                                      SIGKILL the embedded nats-server (a single server); the
                                              supervisor restarted it on its port and store
    postgres                                  fast shutdown of the embedded Postgres; restarted likewise
    engine                                    SIGUSR2 to the rollout, whose `rollout.fault_injection`
                                              (set by gyre chaos) makes its busiest torch engine fail at
                                              its next step through the real crash path; recovered once
                                              the rollout (same process: it lived) reports one more
                                              engine restart admitted and every engine serving. Detail:
                                              the engine that died, the requests it held, migrations
    nats-node                                 SIGKILL the node of the embedded 3-node JetStream cluster
                                              that leads the steps stream (GYRE_STEPS, replicated on
                                              every node); the supervisor restarted that node
                                              (`nats-n<i>`) and every service reports SERVING
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from gyre.errors import GyreError

TARGETS = ("scheduler", "rollout", "trajectory", "trainer", "nats", "postgres", "engine", "nats-node")
DEFAULT_TARGETS = ("scheduler", "rollout", "trajectory", "trainer", "nats", "postgres")
RECOVERY_TIMEOUT_S = 300.0
LIVE_WAIT_S = 60.0  # longest wait for live executions (or a busy engine) before a rollout/engine kill
STEPS_STREAM = "GYRE_STEPS"


@dataclass
class Fault:
    """One injected fault and how the deployment came back from it (times: Unix seconds)."""

    target: str
    at_step: int  # trainer step (weight version) after which it is injected
    delay_s: float  # random delay after that step
    injected_at: float = 0.0
    step_at_kill: int = 0
    recovered: bool = False
    recovery_s: float | None = None  # kill -> target back and every service SERVING
    progress_resumed_s: float | None = None  # kill -> next weight version published
    restarts: list[str] = field(default_factory=list)  # services/servers restarted because of it
    detail: dict[str, Any] = field(default_factory=dict)  # per target: what was hit, what moved
    error: str = ""


def plan_faults(targets: list[str], num_steps: int, rng: random.Random) -> list[Fault]:
    """One fault per target, in order, at steps spread over the run (the last one at least two steps
    before the end, so its recovery is observed), each after a random delay of 0-3 s."""
    span = max(1, num_steps - 3)
    faults = []
    for i, target in enumerate(targets):
        step = 1 + (i * span) // max(1, len(targets))
        faults.append(Fault(target, step, round(rng.uniform(0.0, 3.0), 2)))
    return faults


def all_serving(deployment: Any) -> bool:
    from app.launcher.healthcheck import check

    return all(
        check(ep.grpc_address, timeout_s=2.0) == "SERVING"
        for name, ep in deployment.endpoints.services.items()
        if name not in deployment.stopped_services
    )


async def rollout_status(deployment: Any) -> Any:
    """The rollout's GetStatusResponse (gRPC with the run's token)."""
    from gyre import rpc
    from gyre.v1 import rollout_pb2, rollout_pb2_grpc

    async with rpc.channel(deployment.endpoints.services["rollout"].grpc_address) as channel:
        return await rollout_pb2_grpc.RolloutStub(channel).GetStatus(
            rollout_pb2.GetStatusRequest(), timeout=10
        )


async def steps_stream_leader(deployment: Any) -> str:
    """Server name of the cluster node leading the steps stream (asked as the run's admin user)."""
    from app.launcher.credentials import RunCredentials
    from gyre.bus import Bus, auth

    cluster = deployment.embedded("nats")
    url = RunCredentials.load_or_create(deployment.run_dir).nats_url(cluster.url, auth.ADMIN)
    bus = await Bus.connect(url, name="chaos")
    try:
        info = await bus.js.stream_info(STEPS_STREAM)
    finally:
        await bus.close()
    if info.cluster is None or not info.cluster.leader:
        raise GyreError(f"stream {STEPS_STREAM} reports no leader")
    return str(info.cluster.leader)


def kill_target(deployment: Any, target: str) -> None:
    if target in ("nats", "postgres"):
        server = deployment.embedded(target)
        if server is None or getattr(server, "pid", None) is None:
            raise GyreError(
                f"no single embedded {target} to kill (an external server is not ours to kill; a NATS "
                "cluster's node is the target nats-node)"
            )
        # nats: SIGKILL; postgres: a fast shutdown (SIGINT), which the supervisor turns into a restart.
        os.kill(server.pid, signal.SIGKILL if target == "nats" else signal.SIGINT)
        return
    proc = deployment.process(target)
    if proc is None or proc.returncode is not None:
        raise GyreError(f"service {target} is not running")
    os.kill(proc.pid, signal.SIGKILL)


async def until(predicate: Any, deadline_unix_s: float, poll_s: float) -> bool:
    """Poll `predicate()` (sync or async) until it is true (True) or the deadline passed (False)."""
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return True
        if time.time() > deadline_unix_s:
            return False
        await asyncio.sleep(poll_s)


async def inject_engine_fault(deployment: Any, fault: Fault) -> Any:
    """Wait for a torch engine holding requests, SIGUSR2 the rollout; returns its status before."""
    proc = deployment.process("rollout")
    if proc is None or proc.returncode is not None:
        raise GyreError("service rollout is not running")
    before: list[Any] = []

    async def busy() -> bool:
        before[:] = [await rollout_status(deployment)]
        return any(e.running > 0 for e in before[0].engines)

    await until(busy, time.time() + LIVE_WAIT_S, 0.1)
    fault.detail["rollout_pid"] = proc.pid
    fault.detail["engines_before"] = {e.engine_id: e.running for e in before[0].engines}
    fault.injected_at = time.time()
    os.kill(proc.pid, signal.SIGUSR2)
    return before[0]


async def engine_recovered(deployment: Any, fault: Fault, before: Any) -> bool:
    """One more engine restart admitted, every engine serving, and the rollout the same process."""
    proc = deployment.process("rollout")
    if proc is None or proc.pid != fault.detail["rollout_pid"] or proc.returncode is not None:
        fault.detail["rollout_died"] = True
        return False
    status = await rollout_status(deployment)
    if status.engine_restarts <= before.engine_restarts or any(e.state != "serving" for e in status.engines):
        return False
    gone = sorted(set(fault.detail["engines_before"]) - {e.engine_id for e in status.engines})
    fault.detail.update(
        engine_killed=gone[0] if gone else None,
        engine_restarts=status.engine_restarts - before.engine_restarts,
        requests_held=fault.detail["engines_before"].get(gone[0], 0) if gone else None,
        # generations the router resumed elsewhere with tokens already generated (a request the dead
        # engine held before its first token is resumed too, but not counted as a migration)
        migrations_with_tokens=status.migrations - before.migrations,
        engines_after={e.engine_id: e.weight_version for e in status.engines},
        rollout_died=False,
    )
    return True


async def inject(deployment: Any, tracker: Any, faults: list[Fault]) -> None:
    """Inject `faults` one after the other (module docstring); never raises, errors are recorded."""
    for fault in faults:
        try:
            await until(lambda f=fault: tracker.version >= f.at_step, math.inf, 0.2)
            await asyncio.sleep(fault.delay_s)
            if fault.target in ("rollout", "engine"):
                live = lambda: tracker.executions["started"] > tracker.executions["ended"]  # noqa: E731
                await until(live, time.time() + LIVE_WAIT_S, 0.1)
            fault.step_at_kill = tracker.version
            before: Any = None
            expect = fault.target
            if fault.target == "engine":
                before = await inject_engine_fault(deployment, fault)
            elif fault.target == "nats-node":
                cluster = deployment.embedded("nats")
                if not hasattr(cluster, "nodes"):
                    raise GyreError(
                        "nats-node needs the embedded NATS cluster (launcher.nats_cluster_size 3)"
                    )
                leader = await steps_stream_leader(deployment)
                index = cluster.index_of(leader)
                expect = f"nats-n{index}"
                fault.detail.update(
                    node=expect, steps_stream_leader=leader, meta_leader=cluster.meta_leader()
                )
                fault.injected_at = time.time()
                os.killpg(cluster.nodes[index].pid, signal.SIGKILL)
            else:
                kill_target(deployment, fault.target)
                fault.injected_at = time.time()  # once SIGKILL was sent: nothing it ends after is ours
            deadline = fault.injected_at + RECOVERY_TIMEOUT_S

            async def back(f: Fault = fault, name: str = expect, status: Any = before) -> bool:
                if f.target == "engine":
                    return await engine_recovered(deployment, f, status)
                restarted = any(
                    r.service == name and r.serving_at and r.exited_at >= f.injected_at - 1.0
                    for r in deployment.restarts
                )
                return restarted and await asyncio.to_thread(all_serving, deployment)

            if await until(back, deadline, 0.2):
                fault.recovered = True
                fault.recovery_s = round(time.time() - fault.injected_at, 2)
            fault.restarts = [
                r.service for r in deployment.restarts if r.exited_at >= fault.injected_at - 1.0
            ]
            if not fault.recovered:
                fault.error = f"not recovered within {RECOVERY_TIMEOUT_S:.0f} s"
                continue
            if await until(lambda f=fault: tracker.version >= f.step_at_kill + 1, deadline, 0.2):
                fault.progress_resumed_s = round(time.time() - fault.injected_at, 2)
        except Exception as exc:  # recorded and reported; the next fault still runs
            fault.error = repr(exc)


async def replicas_caught_up(deployment: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """After a nats-node kill: messages of the steps stream held by each node's own copy, polled until
    all agree (a restarted node catches up from the leader) or `timeout_s` passed."""
    cluster = deployment.embedded("nats")
    counts: list[int | None] = []

    def agree() -> bool:
        counts[:] = [cluster.stored_on(i, STEPS_STREAM) for i in range(len(cluster.nodes))]
        return None not in counts and len(set(counts)) == 1

    ok = await until(lambda: asyncio.to_thread(agree), time.time() + timeout_s, 0.5)
    return {"nats_steps_stored_per_node": list(counts), "nats_replicas_agree": ok}


__all__ = [
    "DEFAULT_TARGETS",
    "TARGETS",
    "all_serving",
    "Fault",
    "engine_recovered",
    "inject",
    "inject_engine_fault",
    "kill_target",
    "plan_faults",
    "replicas_caught_up",
    "rollout_status",
    "until",
]
