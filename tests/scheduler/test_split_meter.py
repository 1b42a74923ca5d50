"""Elastic's home split meter (services/scheduler/split_meter.py): it searches the split by measured
step times, never probes past a slower split, ignores differences within its noise margin, and caps
the trainer's share at what its busy time needs."""

from __future__ import annotations

import statistics

from services.scheduler.policies import DeviceState, PoolSnapshot, Role
from services.scheduler.split_meter import SplitMeter


def _snap(version: int, trainer_busy_s: float = 0.0, queued: int = 0, devices: int = 8) -> PoolSnapshot:
    return PoolSnapshot(
        devices=tuple(
            DeviceState(f"d{i}", Role.ROLLOUT if i < devices // 2 else Role.TRAIN) for i in range(devices)
        ),
        live_executions=8,
        queued_generations=queued,
        engine_capacity=4,
        trainer_backlog=1,
        trainer_busy=True,
        latest_version=version,
        trainer_busy_device_s=trainer_busy_s,
    )


def _run(
    meter: SplitMeter, step_s_of_home, steps: int, busy_per_s: float = 1e9, queued: int = 1
) -> list[int]:
    """Feed `steps` step boundaries whose duration depends on the meter's current home; homes seen."""
    t, homes = 0.0, []
    for v in range(steps):
        homes.append(meter.observe(_snap(v, busy_per_s * t, queued), t).measured_home_rollout)
        t += step_s_of_home(meter.home)
    return homes


def test_the_meter_climbs_to_the_fastest_split_and_stays() -> None:
    meter = SplitMeter(probe_steps=1, warmup_steps=0, memory_steps=100)
    homes = _run(meter, lambda home: 100.0 + 10.0 * abs(home - 6), steps=30)
    assert homes[0] == 4  # half the pool before anything is measured
    assert homes[-1] == 6 and homes[-5:] == [6] * 5


def test_the_meter_never_probes_past_a_slower_split() -> None:
    meter = SplitMeter(probe_steps=1, warmup_steps=0)
    homes = _run(meter, lambda home: 100.0 + 10.0 * abs(home - 3), steps=30)  # probes 5 first (queued)
    assert 6 not in homes  # 5 was slower than 4: it turned back instead of going on to 6
    assert homes[-1] == 3


def test_differences_within_the_noise_margin_do_not_move_the_home() -> None:
    meter = SplitMeter(probe_steps=1, warmup_steps=0, memory_steps=100, min_gain=0.05)
    homes = _run(meter, lambda home: 100.0 + home, steps=30)  # 1% a device: inside the 5% margin
    assert len(set(homes[-20:])) == 1 and abs(homes[-1] - 4) <= 1  # one probe, then it stays


def test_forgotten_measurements_are_probed_again_so_the_home_follows_a_drifting_workload() -> None:
    meter = SplitMeter(probe_steps=1, warmup_steps=0, memory_steps=6)
    t, homes = 0.0, []
    for v in range(60):
        homes.append(meter.observe(_snap(v, 1e9 * t, 1), t).measured_home_rollout)
        best = 6 if v < 20 else 3  # the workload drifts at step 20
        t += 100.0 + 10.0 * abs(meter.home - best)
    assert statistics.median(homes[8:20]) == 6
    assert statistics.median(homes[40:]) == 3


def test_a_trainer_busy_a_small_share_of_its_time_keeps_one_device() -> None:
    meter = SplitMeter(probe_steps=1, warmup_steps=0)
    homes = _run(meter, lambda home: 100.0, steps=6, busy_per_s=0.05)  # 5% of one device busy
    assert meter.busy_floor(8) == 7
    assert homes[-1] == 7


def test_a_saturated_trainer_is_not_capped() -> None:
    meter = SplitMeter(probe_steps=1, warmup_steps=0)
    _run(meter, lambda home: 100.0, steps=6, busy_per_s=4.0)  # four devices computing all the time
    assert meter.busy_floor(8) == 1
