"""The policy's inputs, built one way for the live scheduler and for the simulator.

`pool_snapshot` turns the lease table (as `DeviceState`s) and the workers' `WorkerLoad` reports into
the `PoolSnapshot` a policy plans on. The live plan loop (service.py `SchedulerService.snapshot`)
and the simulator (sim/engine.py) both call it, with loads in the same proto message, so a policy
sees in virtual time exactly the fields it sees live, and nothing more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gyre.v1 import scheduler_pb2
from services.scheduler.policies import DeviceState, PoolSnapshot


def pool_snapshot(
    devices: Sequence[DeviceState],
    rollout: Sequence[scheduler_pb2.WorkerLoad],
    trainer: Sequence[scheduler_pb2.WorkerLoad],
    *,
    default_engine_capacity: int,
    staleness_bound: int,
) -> PoolSnapshot:
    """The snapshot of a pool: `devices` in lease order, one load per live rollout / trainer worker.

    Sums over workers where a count is per worker; the engine capacity is the smallest one reported
    (else `default_engine_capacity`); the latest version is the newest the trainer published and the
    oldest live version the oldest any rollout still generates with. Each device takes the load of
    the rollout engine reported on it (`WorkerLoad.engines`, matched by device_id; a device no
    engine names keeps its zeros, an engine on a device not in `devices` is ignored)."""
    capacities = [x.engine_capacity for x in rollout if x.engine_capacity > 0]
    return PoolSnapshot(
        devices=_with_engine_loads(devices, rollout),
        live_executions=sum(x.live_executions for x in rollout),
        queued_generations=sum(x.queued_generations for x in rollout),
        running_generations=sum(x.running_generations for x in rollout),
        waiting_on_environment=sum(x.waiting_on_environment for x in rollout),
        engine_capacity=min(capacities) if capacities else default_engine_capacity,
        trainer_backlog=sum(x.trainer_backlog_batches for x in trainer),
        trainer_busy=any(x.trainer_backlog_batches > 0 for x in trainer),
        trainer_step_s=max((x.trainer_step_s for x in trainer), default=0.0),
        trainer_remaining_work_device_s=sum(x.trainer_remaining_work_device_s for x in trainer),
        trainer_dp_size=sum(x.trainer_dp_size for x in trainer),
        latest_version=max((x.weight_version for x in trainer), default=0),
        oldest_live_version=min((x.weight_version for x in rollout), default=0),
        staleness_bound=staleness_bound,
        rollout_busy_device_s=sum(x.busy_device_s for x in rollout),
        trainer_busy_device_s=sum(x.busy_device_s for x in trainer),
    )


def _with_engine_loads(
    devices: Sequence[DeviceState], rollout: Sequence[scheduler_pb2.WorkerLoad]
) -> tuple[DeviceState, ...]:
    """`devices` with each one's engine load copied from the rollout reports (a device reported by
    two workers, which the lease table rules out, takes the last report)."""
    engines = {e.device_id: e for load in rollout for e in load.engines}
    return tuple(
        dataclasses.replace(
            d, executions=e.executions, generating=e.generating, context_tokens=e.context_tokens
        )
        if (e := engines.get(d.device_id)) is not None
        else d
        for d in devices
    )
