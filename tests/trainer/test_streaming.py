"""Streaming steps: a step trained from parts as they arrive equals one batch of the same groups.

The trajectory service normalises every batch's weights by its own normaliser, so parts of a step
carry weights w / N_i while the step's single batch carries w / (N_1 + ... + N_k). A streaming
trainer pulls the parts one after the other (each journaled), re-normalises them
(`StepNormaliser`) and, in the integration test, changes its data-parallel group at micro-batch
boundaries in the middle of the step — inside a part and between two parts, rank 0's own device
taken away too. In float64 its losses and parameter updates must equal (rtol 1e-6) those of a
trainer that pulls each step as one batch.

The batch source is an in-memory list (the outermost edge: it stands in for the trajectory
service; test_streaming_service.py runs the real one).
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from gyre.model.trees import random_tree
from services.trainer.batch import PackedBatch
from services.trainer.config import TrainerConfig
from services.trainer.loop import StepNormaliser, Trainer
from tests.trainer.helpers import batch_from_tree

MICRO_BATCH_TOKENS = 40
PARTS_PER_STEP = [3, 2]  # step 1 in three parts, step 2 in two
WEIGHTED = ("weight_pos", "weight_neg", "kl_weight")


def _raw_part(seed: int, batch_id: str) -> PackedBatch:
    """A part with un-normalised weights (w = advantage * norm per path, float64)."""
    rng = random.Random(seed)
    out = batch_from_tree(random_tree(rng, 18, max_len=6, num_roots=6), rng, batch_id)
    assert isinstance(out, PackedBatch)
    out.group_ids = [f"g-{batch_id}-{i}" for i in range(len(out.tree_ranges()))]
    out.num_paths, out.reward_sum = len(out.tree_ranges()), 0.25 * seed
    return out


def _normalised(part: PackedBatch, normaliser: float, batch_id: str) -> PackedBatch:
    out = part.scaled(1.0 / normaliser)
    out.batch_id, out.normaliser = batch_id, normaliser
    return out


def _concat(parts: list[PackedBatch], batch_id: str) -> PackedBatch:
    """One batch holding every part's trees (node indices shifted), as the trajectory service would
    pack the same groups in one batch."""
    offsets: list[int] = []
    lengths: list[int] = []
    parents: list[int] = []
    tokens = 0
    for p in parts:
        base_node = len(offsets)
        offsets += [o + tokens for o in p.node_offsets]
        lengths += p.node_lengths
        parents += [q + base_node if q >= 0 else -1 for q in p.node_parents]
        tokens += p.num_tokens
    cat = {
        name: torch.cat([getattr(p, name) for p in parts])
        for name in (
            "token_ids",
            "position_ids",
            "loss_mask",
            *WEIGHTED,
            "behaviour_logprobs",
            "policy_versions",
        )
    }
    return PackedBatch(
        batch_id,
        node_offsets=offsets,
        node_lengths=lengths,
        node_parents=parents,
        num_paths=sum(p.num_paths for p in parts),
        reward_sum=sum(p.reward_sum for p in parts),
        group_ids=[g for p in parts for g in p.group_ids],
        **cat,
    )


def _steps() -> tuple[list[list[PackedBatch]], list[PackedBatch]]:
    """Each step's parts (weights / N_i) and the same step as one batch (weights / sum N_i)."""
    parts, whole, seed = [], [], 0
    for step, count in enumerate(PARTS_PER_STEP):
        raw = [_raw_part(seed := seed + 1, f"s{step}p{i}") for i in range(count)]
        # a normaliser like the trajectory's: trained tokens times a per-part dedup/multiplicity factor
        norms = [float(r.loss_mask.sum()) * (1.0 + 0.37 * i) for i, r in enumerate(raw)]
        parts.append([_normalised(r, n, r.batch_id) for r, n in zip(raw, norms, strict=True)])
        whole.append(_normalised(_concat(raw, f"s{step}"), sum(norms), f"s{step}"))
    return parts, whole


class WholeSource:
    """Serves each step as one batch (the trainer without streaming)."""

    def __init__(self, batches: list[PackedBatch]) -> None:
        self.batches = list(batches)

    async def pull(self, current_version: int, resume_batch_id: str = "") -> PackedBatch | None:
        return self.batches.pop(0) if self.batches else None

    async def ack(self, batch_id: str, version: int) -> None:
        pass


class PartSourceStub:
    """Serves each step as parts; a continuation pull after the step's last part gets nothing (the
    step is complete). Records every part request's (max_tokens, step_tokens)."""

    def __init__(self, steps: list[list[PackedBatch]]) -> None:
        self.steps = [list(s) for s in steps]
        self.by_id = {p.batch_id: p for s in steps for p in s}
        self.current: list[PackedBatch] = []
        self.requests: list[tuple[int, int]] = []
        self.resumed: list[str] = []
        self.acked: list[str] = []

    async def pull(self, current_version: int, resume_batch_id: str = "") -> PackedBatch | None:
        assert resume_batch_id, "a streaming trainer pulls new data as parts only"
        self.resumed.append(resume_batch_id)
        return self.by_id[resume_batch_id]

    async def pull_part(
        self, current_version: int, max_tokens: int, step_tokens: int, wait_s: float
    ) -> PackedBatch | None:
        self.requests.append((max_tokens, step_tokens))
        if step_tokens == 0:
            self.current = self.steps.pop(0) if self.steps else []
        return self.current.pop(0) if self.current else None

    async def ack(self, batch_id: str, version: int) -> None:
        self.acked.append(batch_id)


def _config(streaming: bool, checkpoint_every: int = 100) -> TrainerConfig:
    return TrainerConfig(
        dtype="float64",
        device="cpu",
        lr=1e-2,
        grad_clip=1.0,
        checkpoint_every=checkpoint_every,
        pull_wait_s=0,
        micro_batch_tokens=MICRO_BATCH_TOKENS,
        streaming=streaming,
        stream_wait_s=0,
    )


def _trainer(
    run_dir, streaming: bool, metrics: list[dict[str, float]], source=None, checkpoint_every: int = 100
) -> Trainer:
    parts, whole = _steps()
    if source is None:
        source = PartSourceStub(parts) if streaming else WholeSource(whole)

    async def sink(weights, step_metrics):
        metrics.append(step_metrics)

    return Trainer(_config(streaming, checkpoint_every), run_dir, source, sink, seed=0)


def _assert_same_steps(got, want, streamed: Trainer, reference: Trainer) -> None:
    assert len(got) == len(want) == len(PARTS_PER_STEP)
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        for key in ("loss", "num_tokens", "num_trained_tokens", "grad_norm", "ratio_mean", "num_paths"):
            assert g[key] == pytest.approx(w[key], rel=1e-6, abs=1e-12), f"{key} at step {step}"
        assert g["reward_mean"] == pytest.approx(w["reward_mean"], rel=1e-12)
    for a, b in zip(streamed.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)


async def _fresh_moved(tmp_path, trained: Trainer) -> float:
    fresh = _trainer(tmp_path / "fresh", False, [])
    return max(
        (a - b).abs().max().item()
        for a, b in zip(trained.model.parameters(), fresh.model.parameters(), strict=True)
    )


def test_parts_are_renormalised_to_the_sum_of_their_normalisers():
    norm = StepNormaliser(streaming=True)
    parts, _ = _steps()
    p0, p1, p2 = parts[0]
    n0, n1, n2 = (p.normaliser for p in parts[0])
    assert norm.add(p0) == (1.0, 1.0)
    assert norm.add(p1) == pytest.approx((n0 / (n0 + n1), n1 / (n0 + n1)))
    assert norm.add(p2) == pytest.approx(((n0 + n1) / (n0 + n1 + n2), n2 / (n0 + n1 + n2)))
    assert StepNormaliser(streaming=False).add(p1) == (1.0, 1.0)


async def test_a_streamed_step_equals_one_batch_of_the_same_groups(tmp_path):
    want: list[dict[str, float]] = []
    reference = _trainer(tmp_path / "ref", False, want)
    await reference.run(max_steps=len(PARTS_PER_STEP))
    got: list[dict[str, float]] = []
    streamed = _trainer(tmp_path / "stream", True, got)
    await streamed.run(max_steps=len(PARTS_PER_STEP))

    assert [m["num_parts"] for m in got] == [float(n) for n in PARTS_PER_STEP]
    assert [m["num_parts"] for m in want] == [1.0, 1.0]
    _assert_same_steps(got, want, streamed, reference)
    assert await _fresh_moved(tmp_path, streamed) > 1e-4, "nothing trained: the comparison would be vacuous"
    # every part is recorded as trained by its step (exactly-once: acked at the checkpoint that covers it)
    assert streamed.state.trained_batch_ids == [p.batch_id for s in _steps()[0] for p in s]
    assert streamed.journal.pulled_batch_ids == streamed.state.trained_batch_ids
    # each continuation asked for what is left of the step's budget, strictly
    requests = streamed.source.requests  # type: ignore[attr-defined]
    budget = streamed.cfg.batch_max_tokens
    assert requests[0] == (budget, 0)
    first = _steps()[0][0][0].num_tokens
    assert requests[1] == (budget - first, first)


class Crash(Exception):
    pass


async def test_a_streamed_step_cut_by_a_crash_is_replayed_from_the_journal_and_trained_once(tmp_path):
    source = PartSourceStub(_steps()[0])  # the trajectory service: it outlives the trainer
    first = _trainer(tmp_path / "run", True, [], source, checkpoint_every=1)

    async def crash_in_step_two() -> None:
        if first.state.step == 1 and first.step_parts == 2:
            raise Crash  # the process dies while training step 2's second part

    first.boundary_hooks.append(crash_in_step_two)
    with pytest.raises(Crash):
        await first.run(max_steps=2)
    step_one = [p.batch_id for p in _steps()[0][0]]
    step_two = [p.batch_id for p in _steps()[0][1]]
    assert source.acked == step_one  # step 1 was checkpointed; step 2's parts are only journaled
    assert first.journal.pulled_batch_ids == step_two

    got: list[dict[str, float]] = []
    second = _trainer(tmp_path / "run", True, got, source, checkpoint_every=1)
    assert second.state.step == 1 and second.replay == step_two
    await second.run(max_steps=2)
    assert source.resumed == step_two
    assert source.acked == step_one + step_two  # every part acked once
    assert second.state.trained_batch_ids == step_one + step_two
    assert got[0]["num_parts"] == len(step_two)

    want: list[dict[str, float]] = []
    reference = _trainer(tmp_path / "ref", True, want)  # streamed, never crashed
    await reference.run(max_steps=2)
    assert got[0]["loss"] == pytest.approx(want[1]["loss"], rel=1e-6)
    for a, b in zip(second.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)


# devices held from the k-th boundary on (boundary 0 comes before the first pull)
SCHEDULE = [
    ["d0"],
    ["d0"],
    ["d0", "d1"],  # grows inside the first part
    ["d0", "d1"],
    ["d1"],  # rank 0's device is taken: rank 0 moves onto d1, d1's worker leaves
    ["d1", "d0"],
    ["d0"],
]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_a_streamed_step_resized_mid_step_equals_one_batch_on_one_rank(tmp_path):
    want: list[dict[str, float]] = []
    reference = _trainer(tmp_path / "ref", False, want)
    await reference.run(max_steps=len(PARTS_PER_STEP))

    got: list[dict[str, float]] = []
    streamed = _trainer(tmp_path / "stream", True, got)
    boundary = 0
    seen: list[tuple[int, int, int]] = []  # (step, parts begun, ranks) at each boundary

    async def follow_schedule() -> None:
        nonlocal boundary
        held = SCHEDULE[min(boundary, len(SCHEDULE) - 1)]
        boundary += 1
        streamed.set_devices(held)
        await asyncio.to_thread(streamed.dp.apply, True)
        seen.append((streamed.state.step, streamed.step_parts, streamed.dp.size))
        digests = await asyncio.to_thread(streamed.dp.replica_digests)
        assert len(set(digests)) == 1, f"replicas differ at boundary {boundary}"

    streamed.boundary_hooks.append(follow_schedule)
    streamed.set_devices(SCHEDULE[0])
    try:
        await streamed.run(max_steps=len(PARTS_PER_STEP))
    finally:
        await asyncio.to_thread(streamed.close)

    assert boundary >= len(SCHEDULE), "the schedule did not play out: too few micro-batches"
    assert got[0]["num_parts"] == 3 and got[0]["dp_size_min"] == 1 and got[0]["dp_size_max"] == 2
    # the group changed size inside the first step's first part and again in its later parts
    resized = [seen[i][:2] for i in range(1, len(seen)) if seen[i][2] != seen[i - 1][2]]
    assert (0, 1) in resized and any(step == 0 and parts >= 2 for step, parts in resized), seen
    _assert_same_steps(got, want, streamed, reference)
    assert await _fresh_moved(tmp_path, streamed) > 1e-4
