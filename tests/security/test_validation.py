"""gyre.validation (one definition of a valid step) and its producer end, the rollout's step sink,
against a real nats-server: an invalid step never reaches the step stream, it reaches the
dead-letter stream with its reason, and the valid steps around it are published."""

from __future__ import annotations

import asyncio
import math
import uuid

import pytest
from google.protobuf import any_pb2

from gyre.bus import Bus, subjects
from gyre.bus.wire import DEAD_CODE_HEADER, DEAD_REASON_HEADER, DEAD_SUBJECT_HEADER
from gyre.v1 import events_pb2
from gyre.validation import is_early, step_problem
from services.rollout.steps import BusStepSink


def _step(run_id: str = "r", seq: int = 0, **changes: object) -> events_pb2.StepEvent:
    step = events_pb2.StepEvent(
        event_id=f"e1.{seq}",
        run_id=run_id,
        task_id="t1",
        group_id="g1",
        execution_id="e1",
        call_seq=seq,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        completion_logprobs=[-0.5, -1.25],
        completion_versions=[3, 3],
    )
    for name, value in changes.items():
        field = getattr(step, name)
        if isinstance(value, list):
            field[:] = value
        else:
            setattr(step, name, value)
    return step


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"completion_token_ids": [4, 100_000]}, "token_out_of_vocab"),
        ({"prompt_token_ids": [-1, 2]}, "token_out_of_vocab"),
        ({"completion_logprobs": [-0.5, math.nan]}, "bad_logprob"),
        ({"completion_logprobs": [-0.5, math.inf]}, "bad_logprob"),
        ({"completion_logprobs": [-0.5, 0.5]}, "bad_logprob"),
        ({"completion_versions": [3]}, "length_mismatch"),
        ({"completion_versions": [3, -2]}, "bad_version"),
        ({"completion_versions": [3, 10**12]}, "version_ahead"),
        ({"group_id": ""}, "missing_id"),
        ({"call_seq": -1}, "bad_call_seq"),
        (
            {
                "prompt_token_ids": [],
                "completion_token_ids": [],
                "completion_logprobs": [],
                "completion_versions": [],
            },
            "empty",
        ),
    ],
)
def test_each_kind_of_invalid_step_is_named_by_its_code(changes: dict[str, object], code: str) -> None:
    problem = step_problem(_step(**changes), vocab_size=512, latest_version=3, max_version_lead=2)
    assert problem is not None and problem.code == code
    assert "step e1." in problem.reason


def test_a_valid_step_passes_and_a_slightly_newer_version_is_early_not_invalid() -> None:
    assert step_problem(_step(), vocab_size=512, latest_version=3) is None
    newer = _step(completion_versions=[5, 5])
    assert step_problem(newer, vocab_size=512, latest_version=3, max_version_lead=2) is None
    assert is_early(newer, 3) and not is_early(_step(), 3)
    assert step_problem(newer, vocab_size=512, latest_version=3, max_version_lead=1) is not None
    assert step_problem(_step(completion_token_ids=[4, 100_000]), vocab_size=None) is None  # unchecked


async def test_the_rollout_sink_dead_letters_a_poisoned_step_and_publishes_the_good_ones(
    nats_url: str,
) -> None:
    run_id = f"r{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="rollout")
    await bus.ensure_streams()
    sink = BusStepSink(bus, batch_size=4, vocab_size=512)
    task = sink.start()
    try:
        await sink.publish_step(_step(run_id, 0))
        await sink.publish_step(_step(run_id, 1, completion_token_ids=[4, 100_000]))
        await sink.publish_step(_step(run_id, 2))
        await sink.flush()
        steps = await bus.js.stream_info("GYRE_STEPS", subjects_filter=subjects.steps(run_id, "t1"))
        assert (steps.state.subjects or {}).get(subjects.steps(run_id, "t1")) == 2
        assert sink.num_invalid == 1 and bus.num_dead_letters["token_out_of_vocab"] == 1
        sub = await bus.js.subscribe(
            subjects.dead_letters(run_id, "rollout"), stream="GYRE_DEAD_LETTERS", ordered_consumer=True
        )
        msg = await asyncio.wait_for(sub.next_msg(timeout=10), timeout=15)
        headers = msg.headers or {}
        assert headers[DEAD_CODE_HEADER] == "token_out_of_vocab"
        assert "token id 100000" in headers[DEAD_REASON_HEADER]
        assert headers[DEAD_SUBJECT_HEADER] == subjects.steps(run_id, "t1")
        letter = any_pb2.Any.FromString(msg.data)
        assert letter.type_url.endswith("gyre.v1.StepEvent")
        assert events_pb2.StepEvent.FromString(letter.value).call_seq == 1  # the original, intact
        await sub.unsubscribe()
    finally:
        task.cancel()
        await bus.close()


async def test_an_undecodable_message_is_dead_lettered_by_the_consumer_and_the_rest_delivered(
    nats_url: str,
) -> None:
    run_id = f"r{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="trajectory")
    await bus.ensure_streams()
    got: list[events_pb2.StepEvent] = []

    async def handle(msgs: list[events_pb2.StepEvent]) -> None:
        got.extend(msgs)

    try:
        await bus.js.publish(subjects.steps(run_id, "t1"), b"\xff\xff\xff not a protobuf")
        await bus.publish(subjects.steps(run_id, "t1"), _step(run_id, 0), msg_id="e1.0")
        consumer = await bus.consume(
            subjects.steps(run_id, "*"), events_pb2.StepEvent, handle, durable=f"{run_id}-d"
        )
        async with asyncio.timeout(20):
            while not got or consumer.stats.num_terminated < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        await consumer.stop()
        assert [s.call_seq for s in got] == [0]
        assert bus.num_dead_letters["undecodable"] == 1
        info = await bus.js.stream_info(
            "GYRE_DEAD_LETTERS", subjects_filter=subjects.dead_letters(run_id, "trajectory")
        )
        assert (info.state.subjects or {}).get(subjects.dead_letters(run_id, "trajectory")) == 1
    finally:
        await bus.close()


def test_execution_events_and_progress_signals_are_checked_with_the_same_codes() -> None:
    from gyre.v1 import common_pb2
    from gyre.validation import execution_problem

    def ending(**changes: object) -> events_pb2.ExecutionEvent:
        ev = events_pb2.ExecutionEvent(
            event_id="end.e1", run_id="r", task_id="t1", group_id="g1", execution_id="e1", kind=2, reward=0.5
        )
        for name, value in changes.items():
            setattr(ev, name, value)
        return ev

    assert execution_problem(ending(), reward_range=(0.0, 1.0)) is None
    nan = execution_problem(ending(reward=math.nan))
    assert nan is not None and nan.code == "bad_reward"
    high = execution_problem(ending(reward=7.0), reward_range=(0.0, 1.0))
    assert high is not None and high.code == "bad_reward" and "outside [0.0, 1.0]" in high.reason
    assert execution_problem(ending(kind=99)) is not None
    assert execution_problem(ending(num_calls=-1)) is not None
    lying = ending()
    lying.progress.CopyFrom(common_pb2.ProgressSignal(milestones_reached=5, milestones_total=2))
    problem = execution_problem(lying)
    assert problem is not None and problem.code == "bad_progress"
    step = _step()
    step.progress.CopyFrom(common_pb2.ProgressSignal(tests_passed_fraction=1.5))
    problem = step_problem(step, vocab_size=512)
    assert problem is not None and problem.code == "bad_progress"
