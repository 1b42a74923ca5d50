"""`gyre bench xlong` in small (a 20K-token point, a group of 4) and the compactor on its sub-agents.

The bench runs the real path (embedded NATS and Postgres, the trajectory service as its own process,
the rollout's step sink in another, the trainer's PullBatch client); no timing is asserted here."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from gyre.bus.steps import StepCompactor, rebuild_prompt
from services.trajectory.synthetic import LongConfig, long_executions, step_event


def test_long_executions_reach_their_context_with_stripped_reasoning_retries_and_subagents():
    cfg = LongConfig(context_tokens=20_000, group_size=2, subagent_every=2)
    first, second = long_executions(cfg)
    calls = list(first.calls())
    assert len(calls[-1].prompt) + len(calls[-1].completion) >= 20_000 - cfg.answer_tokens
    assert {c.agent_id for c in calls} > {"main"}  # sub-agents ran
    assert "strip_reasoning" in {c.context_event for c in calls}
    # the first turns are identical across the group, later ones are not
    other = list(second.calls())
    assert np.array_equal(calls[0].completion, other[0].completion)
    assert not np.array_equal(calls[-1].completion, other[-1].completion)
    again = list(long_executions(cfg)[0].calls())  # deterministic: the bench regenerates to check
    assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(calls, again, strict=True))


def test_a_main_call_after_a_subagent_sends_only_its_new_turn():
    (ex,) = long_executions(LongConfig(context_tokens=40_000, group_size=1, subagent_every=3))
    compactor = StepCompactor()
    sequences: dict[int, np.ndarray] = {}
    for c in ex.calls():
        wire = compactor.compact(step_event("r", c))
        if c.call_seq:
            base = sequences[wire.prompt_base_call_seq]
            assert np.array_equal(rebuild_prompt(wire, base), c.prompt)
            if c.agent_id == "main":  # never the whole history again, even right after a sub-agent
                assert len(wire.prompt_token_ids) <= 1.2 * (500 + 3000), c.call_seq  # answer + observation
        sequences[c.call_seq] = np.concatenate([c.prompt, c.completion])


@pytest.mark.slow
def test_the_xlong_bench_at_20k_tokens_stores_exact_trees_and_pulls_micro_batches_within_budget():
    from app.bench import xlong

    args = argparse.Namespace(
        group_size=4, micro_batch_tokens=32_768, train_max_context=0, train_max_mask_bytes=0,
        pull_timeout_s=300.0, seed=0,
    )  # fmt: skip
    import asyncio

    point = asyncio.run(xlong.run_point(20_000, args))
    assert point["trees_exact"] and point["calls_mismatched"] == 0
    assert point["batches_pulled"] == 1 and point["batch_tokens"] == point["tree_tokens"]
    assert point["trained_tokens_once"]
    assert point["micro_batches"] > 1 and point["paths_over_budget"] == 0
    assert point["micro_batches_over_budget"] == 0
    assert point["micro_batch_max_tokens"] <= 32_768
    assert point["steps_unpublishable"] == 0 and point["nats_disconnects"] == 0
    assert point["max_message_bytes"] <= 8 << 20
    # each stored token crosses the wire about once (a prompt token ~2 bytes, a generated one ~7), while
    # full prompts would put every prompt's 2 bytes a token on it
    assert point["wire_bytes"] <= 8 * point["tree_tokens"]
    assert point["wire_bytes_per_flat_token"] < 2
