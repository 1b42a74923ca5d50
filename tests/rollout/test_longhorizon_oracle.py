"""longhorizon's oracle reward: what a perfect policy gets, by the environment's own rules."""

from __future__ import annotations

from services.rollout.environments import Action
from services.rollout.environments.longhorizon import (
    LongHorizonFamily,
    LongHorizonSpec,
    correct_action,
    oracle_reward,
)


async def test_the_oracle_reward_is_what_playing_the_correct_actions_earns_and_every_signal_carries_it() -> (
    None
):
    spec = LongHorizonSpec(max_turns=12, seed=3)
    family = LongHorizonFamily(spec)
    for task_id in family.task_ids(6):
        env = family.make(task_id)
        msgs = await env.reset()
        assert env.progress.extra["oracle_reward"] == oracle_reward(spec, family.task(task_id))
        while True:
            cue = ord(msgs[-1]["content"]) - ord("A")
            res = await env.step(Action.from_ids([correct_action(cue, spec.num_actions)]))
            assert res.progress.extra["oracle_reward"] == env.oracle_reward
            if res.done or res.truncated:
                break
            msgs = res.messages
        assert res.done and res.reward == env.oracle_reward == 1.0


async def test_a_wrong_policy_scores_below_the_oracle() -> None:
    spec = LongHorizonSpec(max_turns=12)
    env = LongHorizonFamily(spec).make("lh-00002")
    msgs = await env.reset()
    while True:
        cue = ord(msgs[-1]["content"]) - ord("A")
        res = await env.step(Action.from_ids([correct_action(cue, spec.num_actions) + 1]))
        if res.done or res.truncated:
            break
        msgs = res.messages
    assert res.truncated and res.progress.score() < res.progress.extra["oracle_reward"]
