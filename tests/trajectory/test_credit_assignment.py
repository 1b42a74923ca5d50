"""Credit assignment: per-call advantages from tree node values and from per-call progress,
on hand-built groups whose numbers are worked out in the comments."""

from __future__ import annotations

import numpy as np
import pytest

from services.trajectory.grouping import score_group
from services.trajectory.packing import pack
from services.trajectory.scoring import (
    Ending,
    Outcome,
    ProgressScorer,
    ProgressSignals,
    call_potentials,
    progress_call_advantages,
    tree_call_advantages,
)
from services.trajectory.tree import TaskTree


def hand_tree() -> TaskTree:
    """Prompt [1, 2]; a and b answer 5, c answers 6; after observation 3, a answers 7, b 8, c 7.

    Nodes and the executions through them (rewards a=1.0, b=0.0, c=0.2, group mean V0=0.4):
      [1 2] a b c -> 0.4;  [5] a b -> 0.5;  [3] (after 5) a b -> 0.5;  [7] a -> 1.0;  [8] b -> 0.0
      [6] c -> 0.2;  [3 7] (after 6) c -> 0.2
    """
    t = TaskTree("task")
    calls = {
        "a": [([1, 2], [5]), ([1, 2, 5, 3], [7])],
        "b": [([1, 2], [5]), ([1, 2, 5, 3], [8])],
        "c": [([1, 2], [6]), ([1, 2, 6, 3], [7])],
    }
    for eid, cs in calls.items():
        for seq, (prompt, completion) in enumerate(cs):
            n = len(completion)
            t.insert_call(
                eid, seq, np.array(prompt), np.array(completion), np.zeros(n), np.zeros(n, np.int64)
            )
    return t


REWARDS = {"a": 1.0, "b": 0.0, "c": 0.2}


def test_tree_local_advantage_is_the_value_change_a_call_made():
    adv = tree_call_advantages(hand_tree(), REWARDS, local_coef=1.0, global_coef=0.0)
    # call 0: V([5]) - V([1 2]) = 0.5 - 0.4 for a and b; V([6]) - 0.4 = -0.2 for c.
    # call 1: V([7]) - V([3]) = 1.0 - 0.5 for a, 0.0 - 0.5 for b; c is alone: its prompt ends inside
    # [3 7] (before = after), so 0: nothing to compare its answer with.
    expected = {"a": {0: 0.1, 1: 0.5}, "b": {0: 0.1, 1: -0.5}, "c": {0: -0.2, 1: 0.0}}
    for e, calls in expected.items():
        assert adv[e] == pytest.approx(calls), e
    # Without rewritten prompts the calls' local terms add up to the execution's GRPO advantage.
    for e in REWARDS:
        assert sum(adv[e].values()) == pytest.approx(REWARDS[e] - 0.4)


def test_tree_global_term_adds_the_value_after_the_call_minus_the_group_mean():
    adv = tree_call_advantages(hand_tree(), REWARDS, local_coef=0.0, global_coef=1.0)
    expected = {"a": {0: 0.1, 1: 0.6}, "b": {0: 0.1, 1: -0.4}, "c": {0: -0.2, 1: -0.2}}
    for e, calls in expected.items():
        assert adv[e] == pytest.approx(calls), e


def test_a_group_whose_rewards_agree_gets_exactly_zero_on_every_call():
    adv = tree_call_advantages(hand_tree(), {"a": 0.3, "b": 0.3, "c": 0.3})
    assert all(v == 0.0 for calls in adv.values() for v in calls.values())


def test_progress_credit_gives_each_call_the_progress_it_made_minus_the_groups_mean():
    # e1 gets all 4 cues right; e2 only its 1st and 3rd: step rewards [.25]*4 and [.25, 0, .25, 0];
    # the mean step reward of the group is 1.5 / 8 = 0.1875.
    pots = {"e1": [0.0, 0.25, 0.5, 0.75, 1.0], "e2": [0.0, 0.25, 0.25, 0.5, 0.5]}
    adv = progress_call_advantages(pots, discount=0.0)
    assert adv["e1"] == pytest.approx([0.0625] * 4)
    assert adv["e2"] == pytest.approx([0.0625, -0.1875, 0.0625, -0.1875])
    # discount 0.5: A_k = sum_j 0.5^(j-k) (r_j - 0.1875), from the last call back.
    assert progress_call_advantages(pots, discount=0.5)["e1"] == pytest.approx(
        [0.1171875, 0.109375, 0.09375, 0.0625]
    )
    # Every call made the same progress: no signal, exactly 0.
    same = progress_call_advantages({"x": [0, 0.5, 1.0], "y": [0, 0.5, 1.0]})
    assert same == {"x": [0.0, 0.0], "y": [0.0, 0.0]}


def test_call_potentials_come_from_the_scorer_and_end_with_the_executions_score():
    scorer = ProgressScorer()
    progress = {0: ProgressSignals(1, 4), 1: ProgressSignals(), 2: ProgressSignals(3, 4)}
    # call 1 reported no signal: it keeps the previous value; the last call ends at the final reward.
    assert call_potentials(scorer, "e", 1.0, [0, 1, 2, 3], progress) == [0.0, 0.25, 0.25, 0.75, 1.0]


def test_per_call_advantages_reach_the_tokens_each_call_generated():
    tree = hand_tree()
    outcomes = {e: Outcome(e, Ending.FINISHED, r, ProgressSignals()) for e, r in REWARDS.items()}
    res = score_group(
        tree, "g", outcomes, ProgressScorer(), normalise_std=False, near_threshold=1.0, credit="tree"
    )
    chunk = pack({"task": tree}, [res.group]).chunks[0]
    norm = 1.0 / 6  # 3 executions x 2 generated tokens, each counted once
    weight = {}
    for off, n, tok in zip(
        chunk.node_offsets, chunk.node_lengths, [chunk.token_ids[o] for o in chunk.node_offsets], strict=True
    ):
        if n == 1 or tok == 3:
            weight[tuple(chunk.token_ids[off : off + n])] = (
                chunk.weight_pos[off + n - 1],
                chunk.weight_neg[off + n - 1],
            )
    assert weight[(5,)] == pytest.approx((0.2 * norm, 0.0))  # a and b generated 5, each +0.1
    assert weight[(6,)] == pytest.approx((0.0, -0.2 * norm))
    assert weight[(7,)] == pytest.approx((0.5 * norm, 0.0))
    assert weight[(8,)] == pytest.approx((0.0, -0.5 * norm))
    assert weight[(3, 7)] == pytest.approx((0.0, 0.0))  # c's 7: advantage 0


def test_progress_credit_divides_by_the_std_of_the_step_rewards_when_asked():
    pots = {"e1": [0.0, 0.25, 0.5, 0.75, 1.0], "e2": [0.0, 0.25, 0.25, 0.5, 0.5]}
    # step rewards: six of 0.25 and two of 0: mean 0.1875, std sqrt(0.75 * 0.25) * 0.25 = 0.10825...
    std = 0.25 * (0.75 * 0.25) ** 0.5
    adv = progress_call_advantages(pots, normalise_std=True, eps=0.0)
    assert adv["e2"] == pytest.approx([0.0625 / std, -0.1875 / std, 0.0625 / std, -0.1875 / std])


def test_a_group_with_equal_rewards_still_teaches_under_progress_credit_and_says_so():
    # a and b both end at reward 0.5, but a made its progress in its first call and b in its
    # second: their final rewards agree (reward_std 0) while their calls' advantages do not.
    tree = hand_tree()
    outcomes = {e: Outcome(e, Ending.FINISHED, 0.5, ProgressSignals()) for e in ("a", "b")}
    progress = {"a": {0: ProgressSignals(1, 2)}, "b": {0: ProgressSignals(0, 2)}}
    kwargs = {"normalise_std": False, "near_threshold": 1.0}
    per_call = score_group(
        tree, "g", outcomes, ProgressScorer(), credit="progress", step_progress=progress, **kwargs
    )
    assert per_call.stats.std == 0.0
    assert per_call.advantage_abs_max == pytest.approx(0.25)  # a's call 0 made 0.5, the mean call 0.25
    per_execution = score_group(tree, "g", outcomes, ProgressScorer(), credit="execution", **kwargs)
    assert per_execution.advantage_abs_max == 0.0
