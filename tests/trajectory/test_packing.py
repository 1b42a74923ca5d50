"""Tree-packed batches: the packed loss equals the per-path loss, ancestry and positions are right."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from gyre.v1 import trajectory_pb2
from services.trajectory.grouping import score_group
from services.trajectory.packing import PackedExecution, ScoredGroup, pack, select_groups, trainable_tokens
from services.trajectory.scoring import Ending, Outcome, ProgressScorer, ProgressSignals
from services.trajectory.synthetic import WorkloadConfig, generate
from services.trajectory.tree import TaskTree

SMALL = WorkloadConfig(
    num_groups=2,
    group_size=6,
    task_prompt_tokens=64,
    num_turns=8,
    generated_tokens=12,
    observation_tokens=20,
    compaction_every=3,
    summary_tokens=10,
    retry_fraction=0.3,
    shared_early_turns=2,
    seed=3,
)


def build(cfg: WorkloadConfig = SMALL):
    execs = generate(cfg)
    trees: dict[str, TaskTree] = {}
    for ex in execs:
        tree = trees.setdefault(ex.task_id, TaskTree(ex.task_id))
        for c in ex.calls:
            tree.insert_call(ex.execution_id, c.call_seq, c.prompt, c.completion, c.logprobs, c.versions)
    return execs, trees


def prefix_value(prefix: bytes, salt: str) -> float:
    """A deterministic random 'per-token loss' that depends only on the token and its prefix, as a model's would."""
    h = hashlib.blake2b(prefix, digest_size=8, person=salt.encode()).digest()
    return int.from_bytes(h, "little") / 2**64 - 0.5


def generated_prefixes(calls) -> dict[bytes, int]:
    """Every generated token of an execution as its full prefix (the token included), each once,
    with the call_seq of the first call that generated it."""
    out: dict[bytes, int] = {}
    for c in sorted(calls, key=lambda c: c.call_seq):
        seq = np.concatenate([c.prompt, c.completion]).astype(np.int32)
        for i in range(len(c.prompt), len(seq)):
            out.setdefault(seq[: i + 1].tobytes(), c.call_seq)
    return out


def step_progress(ex) -> dict[int, ProgressSignals]:
    """A made-up progress report after each call: one more milestone every third call, at most 3 of
    4 (the same for exact duplicates, which made the same calls, as a deterministic environment's)."""
    return {
        c.call_seq: ProgressSignals(min(3, (k + 1) // 3 + len(c.completion) % 2), 4)
        for k, c in enumerate(ex.calls)
    }


def chunk_prefixes(chunk) -> list[bytes]:
    """Rebuild each packed token's prefix from the chunk's ancestry arrays alone."""
    tokens = np.array(chunk.token_ids, np.int32)
    node_tokens = {}
    out = []
    for i, (off, n, par) in enumerate(
        zip(chunk.node_offsets, chunk.node_lengths, chunk.node_parents, strict=True)
    ):
        before = node_tokens[par] if par >= 0 else np.zeros(0, np.int32)
        node_tokens[i] = np.concatenate([before, tokens[off : off + n]])
        for j in range(n):
            out.append(node_tokens[i][: len(before) + j + 1].tobytes())
            assert chunk.position_ids[off + j] == len(before) + j
    return out


def outcomes_for(execs):
    return {
        ex.execution_id: Outcome(
            ex.execution_id,
            Ending.FINISHED if ex.finished else Ending.TRUNCATED,
            ex.reward if ex.finished else None,
            ProgressSignals(ex.milestones_reached, ex.milestones_total),
        )
        for ex in execs
    }


@pytest.mark.parametrize("credit", ["execution", "progress", "tree"])
def test_packed_tree_loss_equals_the_sum_of_per_path_losses(credit):
    execs, trees = build()
    outcomes = outcomes_for(execs)
    scorer = ProgressScorer()
    results = []
    for gid in sorted({ex.group_id for ex in execs}):
        members = [ex for ex in execs if ex.group_id == gid]
        results.append(
            score_group(
                trees[members[0].task_id],
                gid,
                {m.execution_id: outcomes[m.execution_id] for m in members},
                scorer,
                near_threshold=0.5,
                credit=credit,
                step_progress={m.execution_id: step_progress(m) for m in members},
            )
        )
    batch = pack(trees, [r.group for r in results])

    # Reference: every original execution separately, each generated token once, with the
    # advantage of the call that generated it (its own advantage when credit is per execution).
    by_id = {ex.execution_id: ex for ex in execs}
    weight_of = {}
    for r in results:
        for rep, members in r.dedup.members.items():
            for m in members:
                weight_of[m] = (r.advantages[m], r.call_advantages.get(m, {}), r.dedup.weights[rep])
    if credit != "execution":
        assert any(
            len(set(ca.values())) > 1 for _, ca, _ in weight_of.values()
        )  # per call, not per execution
    prefixes = {eid: generated_prefixes(by_id[eid].calls) for eid in weight_of}
    normaliser = sum(dw * len(prefixes[e]) for e, (_, _, dw) in weight_of.items())
    assert np.isclose(batch.normaliser, normaliser)
    ref = 0.0
    for eid, (adv, call_adv, dw) in weight_of.items():
        norm = dw / normaliser
        for p, seq in prefixes[eid].items():
            w = call_adv.get(seq, adv) * norm
            ref += w * prefix_value(p, "pos" if w >= 0 else "neg") + norm * prefix_value(p, "kl")

    packed = 0.0
    for chunk in batch.chunks:
        for t, p in enumerate(chunk_prefixes(chunk)):
            packed += chunk.weight_pos[t] * prefix_value(p, "pos") + chunk.weight_neg[t] * prefix_value(
                p, "neg"
            )
            packed += chunk.kl_weight[t] * prefix_value(p, "kl")
    assert np.isclose(packed, ref, rtol=1e-4, atol=1e-6)
    assert any(d.kind == "exact" for r in results for d in r.dedup.decisions)


def test_each_token_appears_once_and_loss_mask_marks_exactly_the_generated_tokens():
    execs, trees = build()
    gid = execs[0].group_id
    members = [ex.execution_id for ex in execs if ex.group_id == gid]
    group = ScoredGroup(gid, execs[0].task_id, [PackedExecution(e, 1.0, 1, 1.0, 0.5, 0) for e in members])
    batch = pack(trees, [group])
    (chunk,) = batch.chunks
    prefixes = chunk_prefixes(chunk)
    assert len(set(prefixes)) == len(prefixes)
    generated = set().union(*(generated_prefixes(ex.calls) for ex in execs if ex.group_id == gid))
    mask = np.array(chunk.loss_mask, bool)
    assert {p for p, m in zip(prefixes, mask, strict=True) if m} == generated
    assert np.all(np.array(chunk.policy_versions)[~mask] == -1)
    assert not np.any(np.array(chunk.kl_weight)[~mask]) and np.all(np.array(chunk.kl_weight)[mask] > 0)
    assert batch.num_tokens < batch.num_flat_tokens


def test_behaviour_logprobs_come_from_the_call_that_generated_the_token():
    tree = TaskTree("t")
    tree.insert_call(
        "e",
        0,
        np.arange(5, dtype=np.int32),
        np.array([7, 8], np.int32),
        np.array([-0.1, -0.2], np.float32),
        np.array([3, 4]),
    )
    tree.insert_call(
        "e",
        1,
        np.array([0, 1, 2, 3, 4, 7, 8, 9], np.int32),
        np.array([6], np.int32),
        np.array([-0.3], np.float32),
        np.array([5]),
    )
    batch = pack({"t": tree}, [ScoredGroup("g", "t", [PackedExecution("e", 1.0, 1, 1.0, 1.0, 0)])])
    (c,) = batch.chunks
    assert list(c.loss_mask) == [0, 0, 0, 0, 0, 1, 1, 0, 1]
    assert np.allclose(c.behaviour_logprobs, [0, 0, 0, 0, 0, -0.1, -0.2, 0, -0.3])
    assert list(c.policy_versions) == [-1] * 5 + [3, 4, -1, 5]


def test_groups_are_packed_under_the_token_budget_first_fit():
    execs, trees = build()
    gids = sorted({ex.group_id for ex in execs})
    groups = [
        ScoredGroup(
            g,
            g.split("-")[0],
            [PackedExecution(ex.execution_id, 0.0, 1, 1.0, 0.0, 0) for ex in execs if ex.group_id == g],
        )
        for g in gids
    ]
    one = pack(trees, groups[:1]).num_tokens
    assert [g.group_id for g in select_groups(trees, groups, one)] == [gids[0]]
    assert len(select_groups(trees, groups, 10**9)) == 2
    assert len(select_groups(trees, groups, 1)) == 1  # a tree over budget still goes alone


def test_a_selection_with_no_stored_calls_packs_no_chunk_instead_of_failing():
    _, trees = build()
    task_id = sorted(trees)[0]
    ghost = ScoredGroup("g-ghost", task_id, [PackedExecution("never-stepped", 1.0, 1, 1.0, 1.0, 0)])
    packed = pack(trees, [ghost])
    assert packed.chunks == [] and packed.num_tokens == 0 and packed.num_paths == 0


def test_executions_with_only_prompt_tokens_have_nothing_to_train():
    tree = TaskTree("t")
    prompt = np.arange(1, 9, dtype=np.int32)
    empty = np.zeros(0, dtype=np.int32)
    for e in ("e0", "e1"):
        tree.insert_call(e, 0, prompt, empty, np.zeros(0, np.float32), np.zeros(0, np.int64))
    group = ScoredGroup("g", "t", [PackedExecution(e, 0.0, 1, 1.0, 0.0, 0) for e in ("e0", "e1")])
    assert trainable_tokens(tree, group) == 0
    tree.insert_call(
        "e2", 0, prompt, np.array([42], np.int32), np.zeros(1, np.float32), np.zeros(1, np.int64)
    )
    group.executions.append(PackedExecution("e2", 0.0, 1, 1.0, 0.0, 0))
    assert trainable_tokens(tree, group) == 1


def test_a_tree_larger_than_a_chunk_is_streamed_in_bounded_chunks_that_rebuild_the_same_batch():
    from gyre.model.attention import TreeLayout
    from services.trainer.batch import from_chunks

    execs, trees = build()
    groups = [
        ScoredGroup(gid, ex.task_id, [PackedExecution(ex.execution_id, 0.5 - i % 2, 1, 1.0, 1.0, 0)])
        for i, (gid, ex) in enumerate((e.group_id + e.execution_id, e) for e in execs)
    ]
    whole = pack(trees, groups, batch_id="b", max_chunk_bytes=64 << 20)
    streamed: list[trajectory_pb2.BatchChunk] = []
    cut = pack(trees, groups, batch_id="b", max_chunk_bytes=4096, sink=streamed.append)
    assert not cut.chunks  # handed to the sink one at a time, never kept
    assert len(streamed) == cut.num_chunks > len(whole.chunks) == whole.num_trees == cut.num_trees
    assert max(c.ByteSize() for c in streamed) == cut.max_chunk_bytes <= 4096
    assert streamed[-1].last and not any(c.last for c in streamed[:-1])
    assert [c.chunk_index for c in streamed] == list(range(len(streamed)))
    a, b = from_chunks(whole.chunks), from_chunks(streamed)
    for name in ("token_ids", "position_ids", "loss_mask", "weight_pos", "weight_neg", "kl_weight"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert a.behaviour_logprobs.tolist() == b.behaviour_logprobs.tolist()
    assert (a.num_paths, a.num_flat_tokens, sorted(a.group_ids)) == (
        b.num_paths,
        b.num_flat_tokens,
        sorted(b.group_ids),
    )
    # the same attention: a node cut across chunks continues as its own child
    mask_a = TreeLayout(a.num_tokens, a.node_offsets, a.node_lengths, a.node_parents).dense_mask()
    mask_b = TreeLayout(b.num_tokens, b.node_offsets, b.node_lengths, b.node_parents).dense_mask()
    assert bool((mask_a == mask_b).all())
