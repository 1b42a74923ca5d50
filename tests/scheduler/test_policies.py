"""Unit tests of the pure scheduling policies (no I/O)."""

from __future__ import annotations

from typing import Any

from services.scheduler.policies import (
    AsyncPolicy,
    ColocatePolicy,
    DeviceState,
    ElasticPolicy,
    PoolSnapshot,
    Reassignment,
    Role,
    may_start_batch,
)


def _snap(
    roles: list[Role],
    *,
    live: int = 0,
    queued: int = 0,
    cap: int = 4,
    backlog: int = 0,
    busy: bool = False,
    moving: set[int] | None = None,
    step_s: float = 0.0,
    work_device_s: float = 0.0,
    engines: dict[int, tuple[int, int]] | None = None,
) -> PoolSnapshot:
    """`engines`: device index -> (resident executions, context tokens) of the engine on it."""
    moving = moving or set()
    engines = engines or {}
    devices = tuple(
        DeviceState(
            f"d{i:02d}",
            r,
            moving=i in moving,
            executions=engines.get(i, (0, 0))[0],
            context_tokens=engines.get(i, (0, 0))[1],
        )
        for i, r in enumerate(roles)
    )
    return PoolSnapshot(
        devices,
        live,
        queued,
        cap,
        backlog,
        busy,
        trainer_step_s=step_s,
        trainer_remaining_work_device_s=work_device_s,
    )


def test_colocate_moves_whole_pool_to_training_when_batch_is_done() -> None:
    moves = ColocatePolicy().plan(_snap([Role.ROLLOUT] * 4, backlog=1))
    assert {m.device_id for m in moves} == {"d00", "d01", "d02", "d03"}
    assert all(m.to_role == Role.TRAIN for m in moves)


def test_colocate_returns_whole_pool_to_rollout_when_work_is_admitted() -> None:
    moves = ColocatePolicy().plan(_snap([Role.TRAIN] * 3, live=5, queued=5))
    assert [m.to_role for m in moves] == [Role.ROLLOUT] * 3


def test_colocate_is_synchronous_whatever_bound_is_asked() -> None:
    assert ColocatePolicy(staleness_bound=3).staleness_bound == 0


def test_async_keeps_its_fixed_split() -> None:
    moves = AsyncPolicy(2).plan(_snap([Role.IDLE] * 5))
    assert [(m.device_id, m.to_role) for m in moves] == [
        ("d00", Role.ROLLOUT),
        ("d01", Role.ROLLOUT),
        ("d02", Role.TRAIN),
        ("d03", Role.TRAIN),
        ("d04", Role.TRAIN),
    ]
    assert AsyncPolicy(2).plan(_snap([Role.ROLLOUT] * 2 + [Role.TRAIN] * 3, live=50)) == []


def test_elastic_lends_tail_devices_highest_ids_first_while_the_trainer_works() -> None:
    # 4 training devices with 4 x 400 device-s of work: 400 s left, more than 20 role changes of 15 s.
    roles = [Role.ROLLOUT] * 4 + [Role.TRAIN] * 4
    snap = _snap(roles, live=1, cap=4, backlog=1, busy=True, step_s=900.0, work_device_s=1600.0)
    moves = ElasticPolicy().plan(snap)
    assert sorted(m.device_id for m in moves) == ["d01", "d02", "d03"]
    assert all(m.to_role == Role.TRAIN for m in moves)


def _critical_tail(engines: dict[int, tuple[int, int]]) -> PoolSnapshot:
    """4 rollout engines hosting 4 live executions, 4 training devices with a later batch waiting and
    400 s of work each: rollout goes back to its home split of 2 and lends the other 2 engines."""
    roles = [Role.ROLLOUT] * 4 + [Role.TRAIN] * 4
    return _snap(
        roles, live=4, cap=4, backlog=2, busy=True, step_s=900.0, work_device_s=1600.0, engines=engines
    )


def test_elastic_lends_the_emptiest_engines_first() -> None:
    # d00 is empty; d02 and d03 host one execution each, d02 the shorter context; d01 hosts two.
    snap = _critical_tail({0: (0, 0), 1: (2, 9000), 2: (1, 800), 3: (1, 5000)})
    moves = ElasticPolicy(home_rollout_devices=2).plan(snap)
    assert [(m.device_id, m.to_role) for m in moves] == [("d00", Role.TRAIN), ("d02", Role.TRAIN)]


def test_elastic_lends_by_device_id_highest_first_when_engine_loads_tie() -> None:
    equal = _critical_tail({i: (1, 700) for i in range(4)})
    assert [m.device_id for m in ElasticPolicy(home_rollout_devices=2).plan(equal)] == ["d03", "d02"]
    # Equal executions, unequal context: the context decides before the ID does.
    by_context = _critical_tail({0: (1, 100), 1: (1, 100), 2: (1, 700), 3: (1, 700)})
    assert [m.device_id for m in ElasticPolicy(home_rollout_devices=2).plan(by_context)] == ["d01", "d00"]


def test_elastic_keeps_tail_engines_while_the_trainer_waits_for_scored_groups() -> None:
    # Same tail, but the trainer has trained all it has (or has less left than the moves would take):
    # more devices would not speed it up, and the engines they leave would pack live executions.
    roles = [Role.ROLLOUT] * 4 + [Role.TRAIN] * 4
    for work in (0.0, 4 * 2 * 15.0):  # 30 s left on 4 devices: not over a round trip of 15-s role changes
        snap = _snap(roles, live=1, cap=4, backlog=2, busy=True, step_s=900.0, work_device_s=work)
        assert ElasticPolicy().plan(snap) == []


def test_elastic_packs_the_tail_onto_fewer_engines_only_when_asked() -> None:
    # Four tail executions, one per engine, and a trainer with 1,000 s of training on one device.
    roles = [Role.ROLLOUT] * 4 + [Role.TRAIN]
    engines = {0: (1, 100), 1: (1, 200), 2: (1, 300), 3: (1, 400)}
    snap = _snap(roles, live=4, cap=4, backlog=1, busy=True, step_s=900.0, work_device_s=1e3, engines=engines)
    assert ElasticPolicy().plan(snap) == []  # by default every execution keeps its engine
    # Packing on: the four fit one engine of 4, so three engines go, the smallest contexts first
    # (their executions are live-migrated), and the engine with the largest context stays.
    moves = ElasticPolicy(pack_tail=True).plan(snap)
    assert [(m.device_id, m.to_role) for m in moves] == [(f"d0{i}", Role.TRAIN) for i in range(3)]


def test_elastic_never_plans_fewer_slots_than_live_executions() -> None:
    for live in range(0, 17):
        for busy in (False, True):
            snap = _snap(
                [Role.ROLLOUT] * 4 + [Role.TRAIN],
                live=live,
                cap=4,
                backlog=int(busy),
                busy=busy,
                step_s=900.0,
            )
            moves = ElasticPolicy().plan(snap)
            rollout = 4 + sum(1 if m.to_role == Role.ROLLOUT else -1 for m in moves)
            assert rollout * 4 >= live, (live, busy)


def test_elastic_takes_back_its_home_share_from_an_idle_trainer_and_spreads_further_only_when_asked() -> None:
    roles = [Role.ROLLOUT] * 2 + [Role.TRAIN] * 4
    # By default rollout takes back its home share (half the pool, no step yet measured): one device.
    moves = ElasticPolicy().plan(_snap(roles, live=8, queued=0, cap=4, step_s=900.0))
    assert [(m.device_id, m.to_role) for m in moves] == [("d05", Role.ROLLOUT)]
    # Spreading on: one engine per live execution, but the trainer keeps min_train_devices (d02).
    moves = ElasticPolicy(spread_idle=True).plan(_snap(roles, live=8, queued=0, cap=4, step_s=900.0))
    assert sorted(m.device_id for m in moves) == ["d03", "d04", "d05"]
    home = [Role.ROLLOUT] * 3 + [Role.TRAIN] * 3
    assert ElasticPolicy().plan(_snap(home, live=8, cap=4, step_s=0.0)) == []  # no step yet: stay at home


def test_elastic_returns_borrowed_devices_only_when_training_becomes_critical() -> None:
    roles = [Role.ROLLOUT] * 5 + [Role.TRAIN]
    # The trainer works on its step but no later batch waits for it: rollout keeps what it borrowed.
    work = {"busy": True, "step_s": 900.0, "work_device_s": 1e3}
    assert ElasticPolicy().plan(_snap(roles, live=8, cap=4, backlog=1, **work)) == []
    # A later batch is scored and waits behind the running step: back to the home split of 3.
    moves = ElasticPolicy().plan(_snap(roles, live=8, cap=4, backlog=2, **work))
    assert len(moves) == 2 and all(m.to_role == Role.TRAIN for m in moves)


def test_elastic_hosts_every_queued_execution_before_the_home_split() -> None:
    roles = [Role.ROLLOUT] * 3 + [Role.TRAIN] * 3
    moves = ElasticPolicy().plan(_snap(roles, live=18, queued=6, cap=4, backlog=2, busy=True))
    assert len(moves) == 2 and all(
        m.to_role == Role.ROLLOUT for m in moves
    )  # ceil(18 / 4) = 5, trainer keeps 1


def test_elastic_does_not_lend_when_a_training_step_is_shorter_than_the_role_changes() -> None:
    roles = [Role.ROLLOUT] * 3 + [Role.TRAIN]
    # 2 role changes of 15 s = 30 s (the lent device's round trip): a lend must be worth more of the step.
    short = _snap(roles, live=1, cap=4, backlog=1, busy=True, step_s=30.0, work_device_s=20.0)
    long = _snap(roles, live=1, cap=4, backlog=1, busy=True, step_s=600.0, work_device_s=1e4)
    # Home 3 + 1: the trainer holds its home share, so lending more is optional and must pay.
    assert ElasticPolicy(role_change_s=15.0, home_rollout_devices=3).plan(short) == []
    assert len(ElasticPolicy(role_change_s=15.0, home_rollout_devices=3).plan(long)) == 2


def test_elastic_lends_in_a_step_whose_own_training_outlasts_the_role_changes_whatever_the_last_step_took() -> (
    None
):
    roles = [Role.ROLLOUT] * 3 + [Role.TRAIN]
    policy = ElasticPolicy(role_change_s=15.0, home_rollout_devices=3)
    # The last step took 30 s, or none has ended yet, but this one has 100 s of training left on its
    # one device: the step in progress is long, so the two idle tail engines go to the trainer.
    for step_s in (0.0, 30.0):
        moves = policy.plan(
            _snap(roles, live=1, cap=4, backlog=1, busy=True, step_s=step_s, work_device_s=100.0)
        )
        assert [m.to_role for m in moves] == [Role.TRAIN] * 2
    # 25 s left is less than the round trip of two role changes: it stays.
    assert (
        policy.plan(_snap(roles, live=1, cap=4, backlog=1, busy=True, step_s=30.0, work_device_s=25.0)) == []
    )


def test_elastic_returns_borrowed_devices_to_a_trainer_below_its_home_share_before_any_step() -> None:
    # Home 2 + 2; the trainer got work while rollout still holds 3 (it spread over the idle trainer).
    # With the cost rule's factor at 20 (an operator's setting; at the default 2 the training that
    # strands the trainer also pays for a lend) and its cadence unknown (no step yet) or short, no
    # optional move pays; with 100 s of training
    # measured (more than two role changes of 15 s) the one borrowed device still goes back, and only
    # that one (rollout keeps 2 although 1 live execution needs just 1).
    for step_s in (0.0, 30.0):
        roles = [Role.ROLLOUT] * 3 + [Role.TRAIN]
        moves = ElasticPolicy(role_change_s=15.0, min_step_over_switch=20.0).plan(
            _snap(roles, live=1, backlog=1, busy=True, step_s=step_s, work_device_s=100.0)
        )
        assert moves == [Reassignment("d02", Role.TRAIN, moves[0].reason)]
    # At its home share already: nothing moves on a short cadence.
    home = [Role.ROLLOUT] * 2 + [Role.TRAIN] * 2
    assert (
        ElasticPolicy(role_change_s=15.0, min_step_over_switch=20.0).plan(
            _snap(home, live=1, backlog=1, busy=True, step_s=30.0, work_device_s=100.0)
        )
        == []
    )


def test_elastic_gives_a_stranded_trainer_its_home_share_when_its_work_outlasts_two_role_changes() -> None:
    import dataclasses

    snap = _snap([Role.ROLLOUT] * 3, live=0, cap=4, backlog=1, busy=True, step_s=1.0, work_device_s=100.0)
    # At the default cost rule, 100 s of training outlasts the round trip: every idle engine is lent.
    assert len(ElasticPolicy(role_change_s=15.0).plan(snap)) == 3
    # With the factor at 20 (an operator's setting) on a short cadence no lend pays, so the trainer
    # gets its home share (3 - 3 // 2 = 2), not the whole idle rollout: a device it would not use
    # stays where the next batch needs it.
    strict = ElasticPolicy(role_change_s=15.0, min_step_over_switch=20.0)
    assert [m.to_role for m in strict.plan(snap)] == [Role.TRAIN] * 2
    # A home that leaves the trainer nothing (measured, or the operator's) still gives it one device.
    nothing = dataclasses.replace(snap, measured_home_rollout=3)
    assert [m.to_role for m in strict.plan(nothing)] == [Role.TRAIN]
    # Training shorter than two role changes (20 s < 30 s), or not measured yet (0: the live trainer
    # before its first micro-batch): one device, the rest stays with rollout ...
    for work in (20.0, 0.0):
        short = dataclasses.replace(snap, trainer_remaining_work_device_s=work)
        assert [m.to_role for m in ElasticPolicy(role_change_s=15.0).plan(short)] == [Role.TRAIN]
    # ... even with later batches queued behind it (the quickstart's first steps: three batches
    # scored at once, each trained in well under a second): unmeasured work claims no more devices.
    queued = dataclasses.replace(snap, trainer_remaining_work_device_s=0.0, trainer_backlog=3)
    assert [m.to_role for m in ElasticPolicy(role_change_s=15.0).plan(queued)] == [Role.TRAIN]
    # A long cadence with lasting work: every idle engine is lent.
    long = dataclasses.replace(snap, trainer_step_s=900.0, trainer_remaining_work_device_s=1e5)
    assert len(ElasticPolicy(role_change_s=15.0).plan(long)) == 3


def test_after_its_first_step_an_unmeasured_trainer_keeps_what_it_holds_and_gets_no_more() -> None:
    import dataclasses

    # The live quickstart: after step 1 the trainer (1 device) has work, rollout idles between batches.
    # (The cost rule's factor at 20, so that 0.1 s of training is no lend at 0.02-s role changes.)
    policy = ElasticPolicy(role_change_s=0.02, min_step_over_switch=20.0)
    one = dataclasses.replace(
        _snap([Role.ROLLOUT] * 3 + [Role.TRAIN], live=0, backlog=1, busy=True, step_s=3.0, work_device_s=0.1),
        latest_version=1,
    )
    assert policy.plan(one) == []  # before step 1 it would get half the pool
    two = dataclasses.replace(one, devices=one.devices[:2] + tuple(dataclasses.replace(d, role=Role.TRAIN) for d in one.devices[2:3]) + one.devices[3:])  # fmt: skip
    assert two.count(Role.TRAIN) == 2 and policy.plan(two) == []
    # once the meter has measured a home, it rules
    measured = dataclasses.replace(one, measured_home_rollout=2)
    assert [m.to_role for m in policy.plan(measured)] == [Role.TRAIN]
    # ... for a step whose training outlasts two role changes (0.1 s > 0.04 s), not for a shorter one
    brief = dataclasses.replace(measured, trainer_remaining_work_device_s=0.03)
    assert policy.plan(brief) == []


def test_elastic_takes_devices_back_when_new_batch_is_admitted() -> None:
    # 12 queued executions on engines of 4 need 3 devices; the trainer keeps its last one.
    snap = _snap([Role.ROLLOUT] + [Role.TRAIN] * 3, live=12, queued=12, cap=4, step_s=900.0)
    moves = ElasticPolicy().plan(snap)
    assert len(moves) == 2 and all(m.to_role == Role.ROLLOUT for m in moves)


def test_elastic_leaves_moving_devices_alone() -> None:
    snap = _snap([Role.ROLLOUT] * 3, live=0, backlog=1, moving={0, 1, 2})
    assert ElasticPolicy().plan(snap) == []


def test_admission_bounds_staleness() -> None:
    assert may_start_batch(0, 0, 0) and not may_start_batch(1, 0, 0)
    assert may_start_batch(2, 1, 1) and not may_start_batch(3, 1, 1)


def test_elastic_is_pure_same_snapshot_same_moves() -> None:
    snap = _snap([Role.ROLLOUT] * 4 + [Role.TRAIN] * 2, live=2, cap=4, backlog=1, busy=True, step_s=900.0)
    assert ElasticPolicy().plan(snap) == ElasticPolicy().plan(snap)


def test_make_policy_gives_elastic_the_operators_split_as_its_home() -> None:
    from services.scheduler.policies import make_policy

    elastic = make_policy("elastic", num_rollout_devices=3, role_change_s=10.0, min_step_over_switch=5.0)
    assert isinstance(elastic, ElasticPolicy)
    assert (elastic.home_rollout_devices, elastic.role_change_s, elastic.min_step_over_switch) == (
        3,
        10.0,
        5.0,
    )


def test_elastic_moves_devices_both_ways_when_rollout_and_training_alternate() -> None:
    # The e2e elastic case (tests/e2e/test_devices_move.py): 4 devices, engines of 32, synchronous
    # admission, every move pays. Each step is a rollout phase (32 live executions, nothing scored)
    # and a training phase (none live, a batch waiting; a step running or not yet started).
    policy = ElasticPolicy(role_change_s=0.1, min_step_over_switch=0.0)
    roles = [Role.ROLLOUT] * 4
    history: dict[str, list[Role]] = {f"d{i:02d}": [r] for i, r in enumerate(roles)}

    def phase(**kw: Any) -> None:
        for m in policy.plan(_snap(roles, cap=32, **kw)):
            roles[int(m.device_id[1:])] = m.to_role
            history[m.device_id].append(m.to_role)

    phase(live=32)  # batch 0 rolls out on the registered pool; no step yet, nothing optional
    assert roles == [Role.ROLLOUT] * 4
    phase(backlog=1, busy=True)  # batch 0 waits, the trainer holds nothing, its work unmeasured: one device
    assert roles == [Role.ROLLOUT, Role.ROLLOUT, Role.ROLLOUT, Role.TRAIN]
    phase(backlog=1, busy=True, step_s=1.0, work_device_s=0.5)  # its step runs: all of rollout
    assert roles == [Role.TRAIN] * 4
    for _ in range(2):
        phase(live=32, queued=32, step_s=1.0)  # the next batch: rollout takes back its home share (half)
        assert roles == [Role.TRAIN] * 2 + [Role.ROLLOUT] * 2
        phase(backlog=1, busy=True, step_s=1.0)  # a batch waits, its step not started: nothing more
        assert roles == [Role.TRAIN] * 2 + [Role.ROLLOUT] * 2
        phase(backlog=1, busy=True, step_s=1.0, work_device_s=0.5)  # its step runs: all of rollout
        assert roles == [Role.TRAIN] * 4
    for lent in ("d02", "d03"):
        assert history[lent] == [Role.ROLLOUT, Role.TRAIN, Role.ROLLOUT, Role.TRAIN, Role.ROLLOUT, Role.TRAIN]
    assert history["d00"] == history["d01"] == [Role.ROLLOUT, Role.TRAIN]  # the trainer's home share stays
