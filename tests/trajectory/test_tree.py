"""Branch-aware reconstruction: each source of non-prefix history, lossless export, idempotence."""

from __future__ import annotations

import numpy as np
import pytest

from gyre.errors import InvalidArgument
from services.trajectory.tree import TaskTree

rng = np.random.default_rng(0)


def toks(n: int) -> np.ndarray:
    return rng.integers(0, 500, size=n, dtype=np.int32)


def add(
    tree: TaskTree,
    eid: str,
    seq: int,
    prompt: np.ndarray,
    completion: np.ndarray,
    version: int = 0,
    agent: str = "main",
):
    lp = -rng.random(len(completion)).astype(np.float32)
    rec, _ = tree.insert_call(eid, seq, prompt, completion, lp, np.full(len(completion), version), agent)
    return rec


def trained_tokens(tree: TaskTree, eid: str) -> int:
    return tree.generated_tokens(eid)


def assert_lossless(tree: TaskTree, eid: str, calls: list[tuple[np.ndarray, np.ndarray]]) -> None:
    exported = tree.export_execution(eid)
    assert len(exported) == len(calls)
    for (p, c), e in zip(calls, exported, strict=True):
        np.testing.assert_array_equal(e.prompt_token_ids, p)
        np.testing.assert_array_equal(e.completion_token_ids, c)


def test_prefix_extending_history_is_stored_once():
    tree = TaskTree("t")
    task, a1, o1, a2 = toks(50), toks(10), toks(20), toks(10)
    add(tree, "e", 0, task, a1)
    add(tree, "e", 1, np.concatenate([task, a1, o1]), a2)
    assert tree.num_tokens == 90
    assert trained_tokens(tree, "e") == 20
    assert [len(n.path()) for n in tree.leaves_of("e")] == [2]
    assert_lossless(tree, "e", [(task, a1), (np.concatenate([task, a1, o1]), a2)])


def test_context_compaction_branches_after_the_task_prompt():
    tree = TaskTree("t")
    task, a1, _o1, summary, a2 = toks(50), toks(10), toks(20), toks(8), toks(10)
    add(tree, "e", 0, task, a1)
    compacted = np.concatenate([task, summary])  # the summary replaces turn 1
    add(tree, "e", 1, compacted, a2)
    assert tree.num_tokens == 50 + 10 + 8 + 10  # task prompt shared, two branches below it
    assert len(tree.leaves_of("e")) == 2
    assert trained_tokens(tree, "e") == 20
    assert_lossless(tree, "e", [(task, a1), (compacted, a2)])


def test_stripped_reasoning_is_trained_once_where_it_was_generated():
    tree = TaskTree("t")
    task, think, answer, obs, a2 = toks(40), toks(15), toks(5), toks(10), toks(6)
    add(tree, "e", 0, task, np.concatenate([think, answer]))
    later = np.concatenate([task, answer, obs])  # reasoning of the earlier turn stripped
    add(tree, "e", 1, later, a2)
    # The answer copy in the later prompt is a prompt token on another branch: not trained again.
    assert trained_tokens(tree, "e") == 15 + 5 + 6
    assert len(tree.leaves_of("e")) == 2
    assert_lossless(tree, "e", [(task, np.concatenate([think, answer])), (later, a2)])


def test_retry_after_rollback_keeps_both_attempts_as_siblings():
    tree = TaskTree("t")
    task, bad, good, obs, a3 = toks(30), toks(12), toks(12), toks(5), toks(4)
    add(tree, "e", 0, task, bad)
    add(tree, "e", 1, task, good)  # same prompt again: the bad attempt was rolled back
    add(tree, "e", 2, np.concatenate([task, good, obs]), a3)
    assert tree.num_tokens == 30 + 12 + 12 + 5 + 4
    leaves = tree.leaves_of("e")
    assert len(leaves) == 2
    assert trained_tokens(tree, "e") == 12 + 12 + 4


def test_divergence_inside_a_node_splits_it_and_keeps_earlier_calls_exact():
    tree = TaskTree("t")
    base = toks(100)
    alt = base.copy()
    alt[60:] = (alt[60:] + 1) % 500
    add(tree, "e", 0, base[:80], base[80:])
    first_end = tree.calls[("e", 0)].end_node.node_id
    add(tree, "f", 0, alt[:80], alt[80:])
    assert tree.calls[("e", 0)].end_node.node_id == first_end  # stable ids under splits
    assert tree.num_tokens == 100 + 40
    assert_lossless(tree, "e", [(base[:80], base[80:])])
    assert_lossless(tree, "f", [(alt[:80], alt[80:])])


def test_subagent_with_its_own_context_gets_its_own_root():
    tree = TaskTree("t")
    main_sys, sub_sys = np.array([1, 2, 3], np.int32), np.array([9, 8, 7], np.int32)
    add(tree, "e", 0, np.concatenate([main_sys, toks(20)]), toks(5))
    add(tree, "e", 1, np.concatenate([sub_sys, toks(10)]), toks(5), agent="explorer")
    roots = [n for n in tree.iter_nodes() if n.parent is tree.root]
    assert len(roots) == 2
    assert [c.agent_id for c in tree.export_execution("e")] == ["main", "explorer"]


def test_group_members_share_the_task_root_and_identical_early_turns():
    tree = TaskTree("t")
    task, turn1 = toks(64), toks(16)
    for i in range(4):
        add(tree, f"e{i}", 0, task, turn1)  # identical first turn
        add(tree, f"e{i}", 1, np.concatenate([task, turn1, toks(8)]), toks(8))
    assert tree.num_tokens == 64 + 16 + 4 * 16
    assert tree.calls[("e0", 0)].end_node.num_call_ends == 4


def test_redelivered_call_changes_nothing():
    tree = TaskTree("t")
    p, c = toks(10), toks(5)
    add(tree, "e", 0, p, c)
    before = (tree.num_tokens, len(tree.nodes))
    rec, changes = tree.insert_call("e", 0, p, toks(7), np.zeros(7, np.float32), np.zeros(7, np.int64))
    assert rec is None and not changes.created
    assert (tree.num_tokens, len(tree.nodes)) == before


def test_out_of_order_calls_build_the_same_sequences():
    calls = []
    ctx = toks(30)
    for _ in range(6):
        a = toks(5)
        calls.append((ctx.copy(), a))
        ctx = np.concatenate([ctx, a, toks(7)]) if rng.random() < 0.7 else np.concatenate([ctx[:30], toks(4)])
    t1, t2 = TaskTree("t"), TaskTree("t")
    for i, (p, c) in enumerate(calls):
        add(t1, "e", i, p, c)
    for i in reversed(range(len(calls))):
        add(t2, "e", i, *calls[i])
    assert t1.num_tokens == t2.num_tokens
    assert_lossless(t2, "e", calls)


def test_random_histories_round_trip_exactly_with_logprobs_and_versions():
    tree = TaskTree("t")
    expected = {}
    for e in range(5):
        ctx = toks(40)
        for s in range(20):
            comp = toks(int(rng.integers(1, 12)))
            lp = -rng.random(len(comp)).astype(np.float32)
            ver = rng.integers(0, 5, len(comp))
            tree.insert_call(f"e{e}", s, ctx, comp, lp, ver)
            expected[(f"e{e}", s)] = (ctx.copy(), comp, lp, ver)
            r = rng.random()
            if r < 0.6:
                ctx = np.concatenate([ctx, comp, toks(6)])
            elif r < 0.8:
                ctx = np.concatenate([ctx[:40], toks(10)])  # compaction
            # else: retry with the same prompt
    for (eid, s), (p, c, lp, ver) in expected.items():
        out = tree.export_call(tree.calls[(eid, s)])
        np.testing.assert_array_equal(out.prompt_token_ids, p)
        np.testing.assert_array_equal(out.completion_token_ids, c)
        np.testing.assert_array_equal(out.completion_logprobs, lp)
        np.testing.assert_array_equal(out.completion_versions, ver)


def test_mismatched_completion_arrays_are_rejected_with_a_clear_error():
    tree = TaskTree("t")
    with pytest.raises(InvalidArgument, match="same length"):
        tree.insert_call("e", 0, toks(3), toks(4), np.zeros(3, np.float32), np.zeros(4, np.int64))
    assert not tree.nodes


def test_full_prompts_inserted_from_the_previous_call_build_the_same_tree_as_from_the_root():
    from services.trajectory.ingest import shared_with_previous_call
    from services.trajectory.synthetic import WorkloadConfig, generate

    cfg = WorkloadConfig(
        num_groups=1, group_size=3, task_prompt_tokens=64, num_turns=9, generated_tokens=8,
        observation_tokens=12, compaction_every=3, summary_tokens=6, retry_fraction=0.4,
        shared_early_turns=1, seed=11,
    )  # fmt: skip
    plain, hinted = TaskTree("t"), TaskTree("t")
    used_hint = 0
    for ex in generate(cfg):
        for c in ex.calls:
            plain.insert_call(ex.execution_id, c.call_seq, c.prompt, c.completion, c.logprobs, c.versions)
            hint = shared_with_previous_call(hinted, ex.execution_id, c.call_seq, c.prompt)
            used_hint += hint is not None
            hinted.insert_call(
                ex.execution_id, c.call_seq, c.prompt, c.completion, c.logprobs, c.versions, known_prefix=hint
            )
    assert used_hint > 0
    assert hinted.num_tokens == plain.num_tokens and len(hinted.nodes) == len(plain.nodes)
    for key, rec in plain.calls.items():
        other = hinted.calls[key]
        assert np.array_equal(plain.sequence(rec.end_node), hinted.sequence(other.end_node))
        assert rec.prompt_len == other.prompt_len


def test_ingest_remembering_each_executions_last_sequence_builds_the_same_tree_in_any_slice_order():
    """StepIngest compares a full prompt with the previous call's remembered sequence (never rebuilt
    from the tree); with steps arriving shuffled across several ingest calls, the trees still equal
    plain insertion from the root, and every call exports exactly."""
    import random
    from collections import Counter

    from gyre.v1 import trajectory_pb2
    from services.trajectory.ingest import StepIngest, decode_steps
    from services.trajectory.state import TrajectoryState
    from services.trajectory.synthetic import WorkloadConfig, generate, step_event

    cfg = WorkloadConfig(
        num_groups=1, group_size=3, task_prompt_tokens=64, num_turns=9, generated_tokens=8,
        observation_tokens=12, compaction_every=3, summary_tokens=6, retry_fraction=0.4,
        shared_early_turns=1, seed=5,
    )  # fmt: skip
    execs = generate(cfg)
    plain = TaskTree("t")
    for ex in execs:
        for c in ex.calls:
            plain.insert_call(ex.execution_id, c.call_seq, c.prompt, c.completion, c.logprobs, c.versions)
    steps = [step_event("r", c) for ex in execs for c in ex.calls]
    random.Random(3).shuffle(steps)
    ingest = StepIngest("r", TrajectoryState(), None, None, None, Counter())  # type: ignore[arg-type]
    for i in range(0, len(steps), 7):
        decoded, rejected = decode_steps(steps[i : i + 7], "r")
        assert not rejected
        ingest._insert(decoded, [], trajectory_pb2.IngestSummary(), [])
    (tree,) = ingest.state.trees.values()
    for ex in execs:  # what is remembered is each execution's latest call, token for token
        rec, seq = ingest._last_sequences[ex.execution_id]
        assert rec.call_seq == ex.calls[-1].call_seq
        assert np.array_equal(seq, tree.sequence(rec.end_node))
    assert tree.num_tokens == plain.num_tokens and len(tree.nodes) == len(plain.nodes)
    for ex in execs:
        for got, c in zip(tree.export_execution(ex.execution_id), ex.calls, strict=True):
            assert np.array_equal(got.prompt_token_ids, c.prompt)
            assert np.array_equal(got.completion_token_ids, c.completion)


def test_calls_inserted_after_a_base_node_build_the_plain_tree_and_prefix_crcs_match_the_whole_prefix():
    """`insert_call_after` (a compact step: base call's first k tokens + a tail) builds the tree that
    inserting the whole prompt builds, and `prefix_crc32` equals the CRC of the rebuilt prefix, at
    every k (inside nodes, on boundaries, 0 and the base's end), before and after splits."""
    import random

    from gyre.bus.steps import token_crc32
    from services.trajectory.tree import prefix_crc32

    rng = random.Random(11)
    plain, compact = TaskTree("t"), TaskTree("t")
    seqs: list[np.ndarray] = []
    for call in range(60):
        if seqs and rng.random() < 0.8:
            b = rng.randrange(len(seqs))
            base_seq = seqs[b]
            k = rng.choice([0, len(base_seq), rng.randrange(len(base_seq) + 1)])
            tail = np.array([rng.randrange(4) for _ in range(rng.randrange(0, 6))], dtype=np.int32)
            completion = np.array([rng.randrange(4) for _ in range(rng.randrange(1, 6))], dtype=np.int32)
            base_rec = compact.calls[("e", b)]
            assert prefix_crc32(base_rec.end_node, k) == token_crc32(base_seq[:k])
            prompt = np.concatenate([base_seq[:k], tail])
            rec, _ = compact.insert_call_after(
                "e",
                call,
                base_rec.end_node,
                k,
                tail,
                completion,
                np.zeros(len(completion)),
                np.zeros(len(completion)),
            )
        else:
            prompt = np.array([rng.randrange(4) for _ in range(rng.randrange(1, 8))], dtype=np.int32)
            completion = np.array([rng.randrange(4) for _ in range(rng.randrange(1, 6))], dtype=np.int32)
            rec, _ = compact.insert_call(
                "e", call, prompt, completion, np.zeros(len(completion)), np.zeros(len(completion))
            )
        plain.insert_call("e", call, prompt, completion, np.zeros(len(completion)), np.zeros(len(completion)))
        assert rec is not None
        seqs.append(np.concatenate([prompt, completion]))
        got = compact.export_call(rec)
        assert np.array_equal(got.prompt_token_ids, prompt) and np.array_equal(
            got.completion_token_ids, completion
        )
        assert np.array_equal(compact.completion_of(rec), completion)

    def node_sequences(tree: TaskTree) -> set[tuple[int, ...]]:
        return {tuple(tree.sequence(n).tolist()) for n in tree.iter_nodes()}

    assert node_sequences(compact) == node_sequences(plain) and compact.num_tokens == plain.num_tokens
