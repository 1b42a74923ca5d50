"""Event log records are typed before anything is computed from them (app/job/typed_events.py):
a malformed value is an error that names the record and the field, never a silent 0."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.job.analysis import analyse
from app.job.eventlog import EVENT_LOG_NAME, read_events, to_record
from app.job.typed_events import EventLogError, typed
from gyre.v1 import common_pb2, events_pb2


def _weights_record(version: Any) -> dict[str, Any]:
    record = to_record(
        events_pb2.WeightsPublishedEvent(run_id="r", weights=common_pb2.WeightVersion(version=3)),
        recv_unix_s=10.0,
    )
    record["event"]["weights"]["version"] = version
    return record


def test_a_logged_step_is_its_message_plus_the_summary_of_its_tokens() -> None:
    step = events_pb2.StepEvent(
        run_id="r", execution_id="e0", prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5],
        completion_logprobs=[-0.1, -0.2], completion_versions=[2, 3], num_migrations=1,
    )  # fmt: skip
    got = typed(to_record(step, recv_unix_s=5.0))
    assert isinstance(got.event, events_pb2.StepEvent)
    assert (got.event.execution_id, got.event.num_migrations) == ("e0", 1)
    assert got.step is not None
    assert (got.step.num_prompt_tokens, got.step.num_completion_tokens) == (3, 2)
    assert got.step.version_counts == {2: 1, 3: 1}
    assert got.time == 5.0  # no event time of its own: when it was received


def test_a_weights_version_that_is_not_a_number_is_an_error_naming_the_record_and_field() -> None:
    assert typed(_weights_record("7")).event.weights.version == 7  # type: ignore[union-attr]
    with pytest.raises(EventLogError, match=r"record 4 \(WeightsPublishedEvent\).*version"):
        typed(_weights_record("seven"), index=4)


def test_a_field_the_message_does_not_have_is_an_error() -> None:
    record = _weights_record("1")
    record["event"]["wieghts_typo"] = 1
    with pytest.raises(EventLogError, match="wieghts_typo"):
        typed(record)


def test_a_step_summary_with_a_negative_count_is_an_error() -> None:
    record = to_record(events_pb2.StepEvent(run_id="r", completion_token_ids=[1]), recv_unix_s=1.0)
    record["event"]["num_completion_tokens"] = -3
    with pytest.raises(EventLogError, match="num_completion_tokens must be >= 0"):
        typed(record)


def test_the_analysis_refuses_a_log_with_a_malformed_record_instead_of_counting_it_as_zero(
    tmp_path: Path, synthetic_run: Callable[..., Path]
) -> None:
    synthetic_run(tmp_path, num_steps=3, reward_slope=0.1)
    records = read_events(tmp_path / EVENT_LOG_NAME)
    assert analyse(records).num_steps == 3
    scored = next(i for i, r in enumerate(records) if r["type"] == "GroupScoredEvent")
    records[scored]["event"]["num_paths"] = "many"
    with pytest.raises(EventLogError, match=rf"record {scored} \(GroupScoredEvent\).*num_paths"):
        analyse(records)


def test_a_record_of_a_type_this_version_does_not_know_is_counted_and_not_analysed(
    tmp_path: Path, synthetic_run: Callable[..., Path]
) -> None:
    synthetic_run(tmp_path, num_steps=2, reward_slope=0.0)
    records = read_events(tmp_path / EVENT_LOG_NAME)
    before = analyse(records)
    future = {"type": "FutureEvent", "subject": "gyre.future.r", "recv_unix_s": 0.0, "event": {"x": 1}}
    after = analyse([*records, {**future, "recv_unix_s": records[0]["recv_unix_s"]}])
    assert after.num_events["FutureEvent"] == 1
    assert after.num_steps == before.num_steps and after.execution_counts == before.execution_counts
