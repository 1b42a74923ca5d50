"""The RL algorithm learns the long-horizon task: examples/rl_loop.py, run as it ships.

The example runs the real pieces (torch engine + agent loop + longhorizon env, trajectory trees,
GRPO scoring with per-call credit, dedup and tree packing, the trainer's clip-higher PPO tree loss
over batch-normalised advantages with its entropy bonus and AdamW step, weight reload) without
NATS/Postgres; only the step sink is an in-memory list. With a fixed seed the mean reward of the
last iterations must clearly exceed that of the first ones (a random policy scores ~0.25), and each
iteration reports the learning-health numbers the run report shows (entropy, KL to the behaviour
policy, clip fraction, zero-variance groups, the oracle's reward).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"


def load_example() -> ModuleType:
    """examples/ is not a package: import the file itself (the same code `python examples/rl_loop.py` runs)."""
    spec = importlib.util.spec_from_file_location("rl_loop_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
async def test_the_example_loop_learns_well_above_the_random_policy() -> None:
    rl_loop = load_example()
    settings = dataclasses.replace(rl_loop.LearningSettings(), iterations=20, seed=0)
    reports = await rl_loop.run_learning(settings)
    rewards = [r.mean_reward for r in reports]
    print("mean reward per iteration:", " ".join(f"{r:.3f}" for r in rewards))
    first, last = statistics.mean(rewards[:4]), statistics.mean(rewards[-5:])
    assert last > first + 0.12, rewards
    assert last > 0.45, rewards
    assert all(r.oracle_reward == 1.0 for r in reports)  # longhorizon: a perfect policy finishes
    trained = [r.metrics for r in reports if r.metrics]
    assert trained and all(0.0 < m["entropy"] < 6.3 for m in trained)  # nats, at most log(512)
    assert all("kl_behaviour" in m and "clip_fraction" in m for m in trained)
    assert all(0.0 <= r.zero_variance_fraction <= 1.0 for r in reports)
