"""Elastic's home split meter (services/scheduler/split_meter.py): it moves the home only when the
in-step signals show a side short of devices, climbs while the measured steps get faster and undoes
a move that made them slower, ignores the pipeline-filling steps, and caps the trainer's share at
what its busy time and its tail need."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.scheduler.policies import DeviceState, PoolSnapshot, Role
from services.scheduler.split_meter import SplitMeter

DEVICES = 8


@dataclass(frozen=True)
class Pool:
    """A synthetic pool whose every step, under a home split, shows these measurements."""

    step_s: Callable[[int], float]  # wall time of a step under a home
    contention: float = 0.0  # (g - 1) / g of every rollout engine; 0.75: four generations each
    queued: bool = False  # generations wait for an engine all step long
    # Busy device-seconds over the trainer's devices x seconds at the starting home (4 of 8); the
    # trainer's work per step is the same under every home, as a step's work does not depend on it.
    trainer_busy_share: float = 0.2
    tail_s: float = 1.0  # seconds from the last scored work to the step's end, trained on every device


def _snap(meter: SplitMeter, pool: Pool, version: int, busy_s: float, work: float) -> PoolSnapshot:
    home = meter.home or DEVICES // 2
    generating = round(1 / (1 - pool.contention))
    return PoolSnapshot(
        devices=tuple(
            DeviceState(f"d{i}", Role.ROLLOUT, generating=generating)
            if i < home
            else DeviceState(f"d{i}", Role.TRAIN)
            for i in range(DEVICES)
        ),
        live_executions=8,
        queued_generations=4 if pool.queued else 0,
        engine_capacity=4,
        trainer_backlog=1,
        trainer_busy=True,
        latest_version=version,
        trainer_busy_device_s=busy_s,
        trainer_remaining_work_device_s=work,
    )


def _run(
    meter: SplitMeter, pool: Pool | Callable[[int], Pool], steps: int, reported: list[int] | None = None
) -> list[int]:
    """Feed `steps` steps (a snapshot at each start and when the last scored work arrives); the
    meter's home at each step's start (and in `reported` what it told the policy). The trainer's
    work of a step is trained before the arrival and in the tail, all its devices busy in the tail."""
    t, busy, homes = 0.0, 0.0, []
    for v in range(steps):
        p = pool(v) if callable(pool) else pool
        told = meter.observe(_snap(meter, p, v, busy, 0.0), t).measured_home_rollout
        homes.append(meter.home)
        if reported is not None:
            reported.append(told)
        s = p.step_s(meter.home)
        work = p.trainer_busy_share * (DEVICES // 2) * p.step_s(DEVICES // 2)
        tail_work = min(work, p.tail_s * (DEVICES - meter.home))
        meter.observe(_snap(meter, p, v, busy + work - tail_work, 50.0), t + s - p.tail_s)
        busy += work
        t += s
    return homes


def test_the_meter_stays_at_half_while_no_side_is_short_of_devices() -> None:
    meter = SplitMeter()
    homes = _run(meter, Pool(step_s=lambda home: 100.0 + 10.0 * abs(home - 6), trainer_busy_share=0.4), 30)
    assert homes == [4] * 30  # a faster split exists, but nothing measured points to it: no probe


def test_the_pipeline_filling_steps_are_not_measured() -> None:
    meter = SplitMeter()
    _run(meter, Pool(step_s=lambda home: 100.0), 3)  # versions 0..2: steps starting at 0, 1 end by 2
    assert meter.signals(4, steps_needed=1) is None  # bound 1: the first counted step starts at 2


def test_rollout_pressure_climbs_while_steps_get_faster_and_stops_at_the_fastest_split() -> None:
    meter = SplitMeter()
    pool = Pool(step_s=lambda home: 100.0 + 10.0 * abs(home - 6), contention=0.75, trainer_busy_share=0.2)
    homes = _run(meter, pool, 40)
    assert homes[:3] == [4] * 3 and homes[3:6] == [5] * 3  # one step measured at half, then a move
    assert homes[6:] == [6] * 34  # it paid, so on to 6; 7 would saturate the trainer


def test_a_move_that_made_steps_slower_is_undone() -> None:
    meter = SplitMeter(memory_steps=6)
    pool = Pool(step_s=lambda home: 100.0 + 10.0 * abs(home - 5), contention=0.75, trainer_busy_share=0.2)
    homes = _run(meter, pool, 40)
    assert max(homes) == 6
    # Each time the pressure sends it to 6 (after 5's measurements are forgotten), two steps
    # measured there send it back to 5.
    runs = "".join(str(h) for h in homes[3:]).split("5")
    assert all(r in ("", "666") for r in runs[:-1]) and "666".startswith(runs[-1]), homes
    assert homes[3:].count(5) > homes[3:].count(6)


def test_a_generation_queue_is_rollout_pressure_too() -> None:
    meter = SplitMeter()
    homes = _run(meter, Pool(step_s=lambda home: 200.0 - 10.0 * home, queued=True, trainer_busy_share=0.2), 8)
    assert homes[-1] > 4


def test_pressure_does_not_move_the_home_when_the_trainer_would_saturate() -> None:
    meter = SplitMeter()
    homes = _run(meter, Pool(step_s=lambda home: 100.0, contention=0.75, trainer_busy_share=0.7), 20)
    assert homes == [4] * 20  # 0.7 x 4 / 3 devices would be 93% busy


def test_pressure_does_not_move_the_home_when_the_longer_tail_costs_more_than_rollout_gains() -> None:
    meter = SplitMeter()
    homes = _run(meter, Pool(step_s=lambda home: 100.0, contention=0.5, tail_s=30.0), 20)
    assert homes == [4] * 20


def test_a_saturated_trainer_gets_more_devices() -> None:
    meter = SplitMeter()
    homes = _run(meter, Pool(step_s=lambda home: 100.0 - 5.0 * (4 - home), trainer_busy_share=0.95), 12)
    assert homes[-1] < 4


def test_a_move_is_not_followed_by_another_that_way_unless_it_paid() -> None:
    meter = SplitMeter()
    homes = _run(meter, Pool(step_s=lambda home: 100.0, contention=0.75, trainer_busy_share=0.5), 16)
    # One move on the evidence; equal step times there: no further while the meter remembers 4.
    assert set(homes) == {4, 5}


def test_the_home_follows_the_signals_when_the_workload_drifts() -> None:
    meter = SplitMeter(memory_steps=6)

    def pool(v: int) -> Pool:
        # The rollout is short of devices from step 20 on (lengths grew); flat step times before.
        return Pool(step_s=lambda home: 100.0, contention=0.75 if v >= 20 else 0.0, trainer_busy_share=0.5)

    homes = _run(meter, pool, 40)
    assert homes[:20] == [4] * 20
    assert homes[-1] >= 5


def test_a_trainer_busy_a_small_share_of_its_time_keeps_one_device() -> None:
    meter = SplitMeter()
    homes = _run(meter, Pool(step_s=lambda home: 100.0, trainer_busy_share=0.01, tail_s=0.5), 8)
    assert meter.busy_floor(DEVICES) == 7
    assert homes[-1] == 7


def test_a_trainer_whose_training_all_comes_after_the_last_scored_work_keeps_devices_beyond_its_busy_cap() -> (
    None
):
    meter = SplitMeter()
    # Busy 10% of the time on 4 devices (0.4 devices: the busy cap alone would leave it 2), all of it
    # in a 10 s tail after the rollout ended: 40 device-seconds, on 1 device 40% of the step.
    homes = _run(meter, Pool(step_s=lambda home: 100.0, trainer_busy_share=0.1, tail_s=10.0), 8)
    assert meter.tail_devices() == 20 and meter.busy_floor(DEVICES) == 1
    assert homes == [4] * 8


def test_a_trainer_busy_under_a_tenth_of_one_device_keeps_one_device_whatever_its_tail() -> None:
    meter = SplitMeter()
    # 4 device-seconds a 100 s step, all in the tail: 4% of a step on one device. (The live
    # quickstart: 0.1 device-seconds of training in a 3 s step, then waiting for the next batch.)
    homes = _run(meter, Pool(step_s=lambda home: 100.0, trainer_busy_share=0.01, tail_s=5.0), 8)
    assert meter.tail_devices() == 2 and meter.busy_floor(DEVICES) == 7
    assert homes[-1] == 7


def test_the_meter_tells_the_policy_no_home_until_it_has_measured_the_trainer() -> None:
    meter, reported = SplitMeter(), []
    _run(meter, Pool(step_s=lambda home: 100.0, trainer_busy_share=0.2, tail_s=0.5), 8, reported)
    # versions 0-2 fill the pipeline (bound 1); the step from 2 to 3 is the first whose tail is
    # measured; its busy time (0.8 devices: cap 3) is known from the step from 1 to 2
    assert reported[:3] == [0, 0, 0] and reported[3:] == [5] * 5
    light, reported = SplitMeter(), []
    _run(light, Pool(step_s=lambda home: 100.0, trainer_busy_share=0.01, tail_s=0.5), 8, reported)
    # a trainer busy under a tenth of a device needs no tail: known after the step from 1 to 2
    assert reported[:2] == [0, 0] and reported[2:] == [7] * 6


def test_a_saturated_trainer_is_not_capped() -> None:
    meter = SplitMeter()
    _run(meter, Pool(step_s=lambda home: 100.0, trainer_busy_share=1.0), 6)
    assert meter.busy_floor(DEVICES) == 1
