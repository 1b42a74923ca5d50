"""The RL algorithm learns the long-horizon task: rollout -> tree/score/pack -> train -> reload, in one process.

Runs the real pieces (torch engine + agent loop + longhorizon env, trajectory trees, GRPO scoring,
dedup and tree packing, the trainer's PPO-clipped tree loss and AdamW step, weight reload) without
NATS/Postgres; only the step sink is an in-memory list (tests/helpers/learning.py). With a fixed
seed the mean reward of the last iterations must clearly exceed that of the first ones (a random
policy scores ~0.25).
"""

from __future__ import annotations

import statistics

from tests.helpers.learning import LearningSettings, run_learning

SETTINGS = LearningSettings(
    iterations=20,
    tasks_per_iteration=8,
    group_size=8,
    lr=3e-3,
    init_std=0.5,
    max_turns=3,
    max_tokens=1,
    temperature=1.0,
    seed=0,
)


async def test_mean_reward_rises_well_above_the_random_policy() -> None:
    reports = await run_learning(SETTINGS)
    rewards = [r.mean_reward for r in reports]
    print("mean reward per iteration:", " ".join(f"{r:.3f}" for r in rewards))
    first, last = statistics.mean(rewards[:4]), statistics.mean(rewards[-5:])
    assert last > first + 0.12, rewards
    assert last > 0.35, rewards
