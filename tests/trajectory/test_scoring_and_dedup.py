"""Partial-progress scoring, GRPO advantages with multiplicity, exact and near-duplicate dedup."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gyre.errors import InvalidArgument
from services.trajectory.dedup import dedup_group
from services.trajectory.grouping import score_group
from services.trajectory.scoring import (
    Ending,
    Outcome,
    ProgressScorer,
    ProgressSignals,
    group_advantages,
    node_values,
)
from services.trajectory.tree import TaskTree

scorer = ProgressScorer()


def test_finished_execution_gets_its_final_reward():
    s = scorer.score(Outcome("e", Ending.FINISHED, 0.75, ProgressSignals()))
    assert (s.reward, s.partial, s.source) == (0.75, False, "final")


def test_truncated_execution_is_scored_from_tests_passing_and_marked_partial():
    s = scorer.score(Outcome("e", Ending.TRUNCATED, None, ProgressSignals(1, 4, 0.3)))
    assert (s.reward, s.partial, s.source) == (0.3, True, "tests")


def test_failed_execution_without_tests_is_scored_from_milestones():
    s = scorer.score(Outcome("e", Ending.FAILED, None, ProgressSignals(3, 4)))
    assert (s.reward, s.partial, s.source) == (0.75, True, "milestones")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1.5, -0.1])
def test_nan_infinite_or_out_of_range_reward_is_rejected_with_a_clear_error(bad):
    with pytest.raises(InvalidArgument, match=r"execution 'e7'.*reward"):
        scorer.score(Outcome("e7", Ending.FINISHED, bad, ProgressSignals()))


def test_nan_progress_fraction_is_rejected():
    with pytest.raises(InvalidArgument, match="tests_passed_fraction"):
        scorer.score(Outcome("e", Ending.TRUNCATED, None, ProgressSignals(tests_passed_fraction=math.nan)))


def test_group_advantages_are_zero_mean_and_unit_std():
    st = group_advantages([0.0, 1.0, 1.0, 0.0])
    assert st.mean == 0.5 and np.isclose(np.std(st.advantages), 1.0, atol=1e-4)


def test_node_value_is_the_mean_reward_of_the_executions_below():
    assert node_values({"a": [1, 2], "b": [1, 3]}, {"a": 1.0, "b": 0.0}) == {1: 0.5, 2: 1.0, 3: 0.0}


def _tree_with(members: dict[str, list[np.ndarray]]) -> TaskTree:
    tree = TaskTree("t")
    prompt = np.arange(20, dtype=np.int32)
    for eid, comps in members.items():
        ctx = prompt
        for s, c in enumerate(comps):
            tree.insert_call(eid, s, ctx, c, np.zeros(len(c), np.float32), np.zeros(len(c), np.int64))
            ctx = np.concatenate([ctx, c, np.array([499], np.int32)])
    return tree


rng = np.random.default_rng(1)


def test_exact_duplicates_merge_with_multiplicity_and_keep_group_statistics():
    a, b = (
        [rng.integers(0, 400, 50, dtype=np.int32) for _ in range(3)],
        [rng.integers(0, 400, 50, dtype=np.int32) for _ in range(3)],
    )
    tree = _tree_with({"e0": a, "e1": a, "e2": b})
    outcomes = {
        e: Outcome(e, Ending.FINISHED, r, ProgressSignals())
        for e, r in [("e0", 1.0), ("e1", 1.0), ("e2", 0.0)]
    }
    res = score_group(tree, "g", outcomes, scorer)
    reps = {p.execution_id: p for p in res.group.executions}
    assert set(reps) == {"e0", "e2"} and reps["e0"].multiplicity == 2
    plain = group_advantages([1.0, 1.0, 0.0])
    assert np.isclose(res.stats.mean, plain.mean) and np.isclose(res.stats.std, plain.std)
    assert np.isclose(reps["e0"].advantage, plain.advantages[0])
    assert res.dedup.num_exact_merged == 1


def test_near_duplicates_are_down_weighted_not_dropped_and_recorded():
    base = [rng.integers(0, 400, 200, dtype=np.int32) for _ in range(4)]
    near = [c.copy() for c in base]
    near[3][-5:] = 1
    other = [rng.integers(0, 400, 200, dtype=np.int32) for _ in range(4)]
    tree = _tree_with({"e0": base, "e1": near, "e2": other})
    dd = dedup_group(tree, ["e0", "e1", "e2"], threshold=0.8)
    assert dd.weights == {"e0": 0.5, "e1": 0.5, "e2": 1.0}
    assert dd.num_near_duplicates == 2
    assert all(d.similarity >= 0.8 for d in dd.decisions)


def test_a_group_is_never_reduced_to_identical_members():
    base = [rng.integers(0, 400, 200, dtype=np.int32) for _ in range(4)]
    near = [c.copy() for c in base]
    near[3][-5:] = 1
    tree = _tree_with({"e0": base, "e1": near})
    dd = dedup_group(tree, ["e0", "e1"], threshold=0.8)
    assert dd.weights == {"e0": 1.0, "e1": 1.0}
    assert {d.kind for d in dd.decisions} == {"near_kept"}


def test_bad_reward_in_a_group_raises_before_anything_is_scored():
    tree = _tree_with({"e0": [np.arange(5, dtype=np.int32)]})
    with pytest.raises(InvalidArgument, match="nan"):
        score_group(tree, "g", {"e0": Outcome("e0", Ending.FINISHED, math.nan, ProgressSignals())}, scorer)
