"""Context parallelism inside elastic data parallelism: replicas of CP = 2 gloo processes (each CP rank
trains the tokens of its contiguous slice of every micro-batch), resized 1 -> 2 replicas mid-step,
train the same weights as one process.

Float64, rtol 1e-6 against the one-process step on the same batches (the tolerance of the TP tests:
the CP sum, the DP sum and the shards change the float summation order, so equality is to rounding,
not bitwise). Bitwise where the order is the same: after every resize each (TP, CP) position of every
replica holds exactly what that position of DP rank 0 holds.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.trainer.config import TrainerConfig
from services.trainer.step import build_replica, train_batch
from services.trainer.tp_replica import FullState, TensorParallelReplicas
from tests.trainer.helpers import DeviceSchedule
from tests.trainer.test_elastic_tp_dp import ATOL, MICRO_BATCH_TOKENS, NUM_STEPS, RTOL, _batches, _cfg

# devices held from the k-th micro-batch boundary on (CP = 2: two devices per replica)
SCHEDULE = [
    ["d0", "d1"],  # one replica of two CP ranks
    ["d0", "d1", "d2"],  # d2 waits (no whole replica)
    ["d0", "d1", "d2", "d3"],  # two replicas, mid-step
]


def _reference() -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    cfg = _cfg()
    model, optimizer, ref_model, settings = build_replica(cfg, "cpu")
    metrics = [
        train_batch(model, optimizer, batch, settings, ref_model, cfg.grad_clip, MICRO_BATCH_TOKENS)
        for batch in _batches()
    ]
    return {n: p.detach().clone() for n, p in model.named_parameters()}, metrics


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_cp2_replica_grown_to_two_mid_step_splits_each_micro_batch_and_equals_one_process():
    expected, expected_metrics = _reference()
    initial = {n: p.detach().clone() for n, p in build_replica(_cfg(), "cpu")[0].named_parameters()}
    held: dict[str, FullState] = {"state": {"weights": initial}}
    group = TensorParallelReplicas(
        _cfg(), 1, lambda: held["state"], lambda s: held.update(state=s), cp_size=2
    )
    boundary, sizes, waiting, norms, token_counts = 0, [], [], [], []
    try:
        for batch in _batches():
            for k, micro in enumerate(batch.micro_batches(MICRO_BATCH_TOKENS)):
                group.request_devices(SCHEDULE[min(boundary, len(SCHEDULE) - 1)])
                boundary += 1
                group.apply(wait=True)
                if k == 0:
                    group.begin_step()
                sizes.append(group.size)
                waiting.append(group.waiting_devices)
                digests = group.replica_digests()
                for position in range(2):
                    assert len({d[position] for d in digests}) == 1, f"replicas differ at {boundary}"
                parts = group.micro(micro)
                assert len(parts) == 2 * group.size  # one per CP rank of every replica
                # the CP ranks of a replica own disjoint token slices that add up to its shard
                token_counts.append((sum(p["num_tokens"] for p in parts), micro.num_tokens))
                assert all(p["num_tokens"] < micro.num_tokens for p in parts if p["num_tokens"])
            norms.append(group.finish_step())
        got = group.full_weights_now()
    finally:
        group.close()

    assert sizes[:3] == [1, 1, 2] and waiting[1] == ["d2"]
    assert all(a == b for a, b in token_counts)
    assert norms == pytest.approx([m["grad_norm"] for m in expected_metrics], rel=RTOL)
    assert any(n > _cfg().grad_clip for n in norms), "clipping should be exercised"
    gap = 0.0
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL, msg=name)
        gap = max(gap, float((got[name] - value).abs().max() / value.abs().max()))
    print(f"CP=2 elastic vs CP=1: largest weight gap (max |w - w_ref| / max |w_ref|) {gap:.1e}")


# the trainer's own loop with CP = 2: devices held from the k-th boundary on (boundary 0 comes
# before the first pull)
TRAINER_SCHEDULE = [
    ["d0", "d1"],  # one replica
    ["d0", "d1", "d2"],  # d2 waits
    ["d0", "d1", "d2", "d3"],  # two replicas, mid-step
    ["d2", "d3"],  # DP rank 0's replica leaves: (d2, d3) carries the step on
]


def _trainer(run_dir, cp: int, metrics: list[dict[str, float]]):
    from services.trainer.loop import Trainer
    from tests.trainer.test_elastic_dp import ListSource

    cfg = _cfg().model_copy(update={"context_parallel_size": cp, "checkpoint_every": 100, "pull_wait_s": 0})

    async def sink(weights, step_metrics):
        metrics.append(step_metrics)

    return Trainer(
        TrainerConfig.model_validate(cfg.model_dump()), run_dir, ListSource(_batches()), sink, seed=0
    )


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
async def test_the_trainer_loop_with_cp2_replicas_resized_mid_step_equals_the_cp1_trainer(tmp_path):
    reference_metrics: list[dict[str, float]] = []
    reference = _trainer(tmp_path / "ref", 1, reference_metrics)
    await reference.run(max_steps=NUM_STEPS)

    metrics: list[dict[str, float]] = []
    elastic = _trainer(tmp_path / "cp2", 2, metrics)
    sizes = []

    async def check(boundary: int) -> None:
        sizes.append(elastic.dp.size)
        assert elastic.tp is not None
        digests = await asyncio.to_thread(elastic.tp.replica_digests)
        for position in range(2):
            assert len({d[position] for d in digests}) == 1, f"replicas differ at boundary {boundary}"

    schedule = DeviceSchedule(elastic, TRAINER_SCHEDULE, check)
    try:
        await elastic.run(max_steps=NUM_STEPS)
    finally:
        await asyncio.to_thread(elastic.close)

    assert schedule.boundaries >= len(TRAINER_SCHEDULE), (
        "the schedule did not play out: too few micro-batches"
    )
    assert {1, 2} <= set(sizes)
    for key in ("grad_norm", "loss", "ratio_mean", "entropy"):
        got, want = [m[key] for m in metrics], [m[key] for m in reference_metrics]
        assert got == pytest.approx(want, rel=RTOL), key
    for key in ("num_tokens", "num_trained_tokens"):
        assert [m[key] for m in metrics] == [m[key] for m in reference_metrics], key
    expected = dict(reference.model.named_parameters())
    gap = 0.0
    for name, value in elastic.model.named_parameters():  # the mirror: what is published and checkpointed
        torch.testing.assert_close(value.detach(), expected[name].detach(), rtol=RTOL, atol=ATOL, msg=name)
        want = expected[name].detach()
        gap = max(gap, float((value.detach() - want).abs().max() / want.abs().max()))
    loss_gap = max(
        abs(m["loss"] - r["loss"]) / abs(r["loss"]) for m, r in zip(metrics, reference_metrics, strict=True)
    )
    print(f"trainer CP=2 vs CP=1: largest loss gap {loss_gap:.1e}, weight gap {gap:.1e}")
    assert elastic.state.step == NUM_STEPS and elastic.latest_weights.version == NUM_STEPS
