"""Tensor parallelism inside elastic data parallelism: replicas of TP = 2 gloo processes, resized
2 -> 1 -> 2 replicas at micro-batch boundaries inside a step, train the same weights as one process.

Float64, rtol 1e-6 against the one-process step (train_batch, TP = 1) on the same batches: the
summation order differs (shards per replica, vocabulary-parallel loss, the norm's TP all-reduce), so
equality is to rounding, not bitwise. Bitwise is checked where the order is the same: after every
resize TP rank r of every replica holds exactly what TP rank r of DP rank 0 holds, and a replica
swapped for a new one (same shards, same order) changes no bit of the result. Last, the trainer's
own loop with trainer.tensor_parallel_size 2, parked with no device mid-step, equals the TP = 1 loop.
"""

from __future__ import annotations

import pytest
import torch

from services.trainer.config import TrainerConfig
from services.trainer.step import build_replica, train_batch
from services.trainer.tp_replica import FullState, TensorParallelReplicas, replicas_of
from tests.trainer.helpers import DeviceSchedule, random_batch

RTOL, ATOL = 1e-6, 1e-10
MICRO_BATCH_TOKENS = 40
NUM_STEPS = 2
# devices held from the k-th micro-batch boundary of the run on (TP = 2: two devices per replica)
SCHEDULE = [
    ["d0", "d1", "d2", "d3"],  # 2 replicas
    ["d2", "d3"],  # DP rank 0's replica leaves mid-step: (d2, d3) becomes DP rank 0
    ["d2", "d3", "d4", "d5", "d6"],  # 2 replicas, d6 waits (no whole replica)
]


def test_held_devices_form_whole_replicas_and_a_leftover_device_waits():
    assert replicas_of(["a", "b", "c"], [], 2) == [("a", "b")]
    kept = [("c", "d")]
    assert replicas_of(["a", "c", "d", "e", "f"], kept, 2) == [("c", "d"), ("a", "e")]
    assert replicas_of(["a", "d"], kept, 2) == [("a", "d")]  # (c, d) lost c: a new pair forms
    assert replicas_of(["a"], [], 1) == [("a",)]


def _cfg() -> TrainerConfig:
    return TrainerConfig(
        dtype="float64", device="cpu", lr=1e-2, grad_clip=1.0, micro_batch_tokens=MICRO_BATCH_TOKENS
    )


def _batches() -> list:
    return [
        random_batch(300 + i, num_nodes=24, batch_id=f"b{i}", num_roots=8).to("cpu", torch.float64)
        for i in range(NUM_STEPS)
    ]


def _run_tp2(schedule: list[list[str]], initial: dict[str, torch.Tensor]) -> dict[str, object]:
    """Train the batches on TP = 2 replicas following `schedule` (devices held from the k-th
    micro-batch boundary on), checking at every boundary that the replicas' TP shards agree bitwise."""
    held: dict[str, FullState] = {"state": {"weights": initial}}  # the state while no replica holds it
    group = TensorParallelReplicas(_cfg(), 2, lambda: held["state"], lambda s: held.update(state=s))
    boundary, sizes, norms, waiting = 0, [], [], []
    try:
        for batch in _batches():
            micros = batch.micro_batches(MICRO_BATCH_TOKENS)
            for k, micro in enumerate(micros):
                group.request_devices(schedule[min(boundary, len(schedule) - 1)])
                boundary += 1
                group.apply(wait=True)
                if k == 0:
                    group.begin_step()
                sizes.append(group.size)
                waiting.append(group.waiting_devices)
                digests = group.replica_digests()
                for tp_rank in range(2):
                    assert len({d[tp_rank] for d in digests}) == 1, f"replicas differ at boundary {boundary}"
                group.micro(micro)
            norms.append(group.finish_step())
        weights = group.full_weights_now()
    finally:
        group.close()
    assert boundary > len(schedule), "the schedule did not play out: too few micro-batches"
    return {
        "weights": weights,
        "sizes": sizes,
        "waiting": waiting,
        "norms": norms,
        "generation": group.generation,
    }


def _initial() -> dict[str, torch.Tensor]:
    model, _, _, _ = build_replica(_cfg(), "cpu")
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_tp2_replicas_resized_mid_step_train_the_weights_of_one_process():
    cfg = _cfg()
    model, optimizer, ref_model, settings = build_replica(cfg, "cpu")
    initial = _initial()
    expected_norms = []
    for batch in _batches():
        metrics = train_batch(model, optimizer, batch, settings, ref_model, cfg.grad_clip, MICRO_BATCH_TOKENS)
        expected_norms.append(metrics["grad_norm"])
    expected = {n: p.detach() for n, p in model.named_parameters()}
    assert any(n > cfg.grad_clip for n in expected_norms), "clipping should be exercised"

    run = _run_tp2(SCHEDULE, initial)
    got = run["weights"]
    assert isinstance(got, dict)
    assert run["sizes"][:3] == [2, 1, 2] and run["waiting"][2] == ["d6"]  # type: ignore[index]
    assert run["generation"] == 3
    assert run["norms"] == pytest.approx(expected_norms, rel=RTOL)
    assert set(got) == set(expected)
    gap = 0.0
    for name, value in expected.items():
        assert got[name].shape == value.shape
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL, msg=name)
        gap = max(gap, float((got[name] - value).abs().max() / value.abs().max()))
    moved = max(float((expected[n] - initial[n]).abs().max()) for n in expected)
    assert moved > 1e-3, "the steps should change the weights"
    print(f"TP=2 elastic vs TP=1: largest weight gap (max |w - w_ref| / max |w_ref|) {gap:.1e}")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_replica_swapped_mid_step_for_a_new_one_changes_no_bit_of_the_result():
    # the same two DP ranks and shards at every micro-batch, so the same reduction order: bitwise
    initial = _initial()
    fixed = _run_tp2([["d0", "d1", "d2", "d3"]], initial)
    swapped = _run_tp2([["d0", "d1", "d2", "d3"], ["d2", "d3", "d4", "d5"]], initial)
    assert swapped["sizes"] == fixed["sizes"] and set(swapped["sizes"]) == {2}  # type: ignore[arg-type]
    assert swapped["generation"] == 2 and fixed["generation"] == 1
    assert swapped["norms"] == fixed["norms"]
    a, b = fixed["weights"], swapped["weights"]
    assert isinstance(a, dict) and isinstance(b, dict)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# the trainer's own loop with TP = 2: devices held from the k-th boundary on (boundary 0 comes
# before the first pull)
TRAINER_SCHEDULE = [
    ["d0", "d1", "d2"],  # one replica; d2 waits
    ["d0", "d1", "d2"],
    ["d0", "d1", "d2", "d3"],  # two replicas
    [],  # no device mid-step: the state (gradient so far included) goes to the mirror, the loop parks
    ["d2", "d3"],  # a new replica, seeded from the mirror, resumes the step
]


def _trainer(run_dir, tp: int, metrics: list[dict[str, float]], sharding: str = "none"):
    from services.trainer.loop import Trainer
    from tests.trainer.test_elastic_dp import ListSource

    cfg = _cfg().model_copy(
        update={
            "tensor_parallel_size": tp,
            "checkpoint_every": 100,
            "pull_wait_s": 0,
            "optimizer_sharding": sharding,
        }
    )

    async def sink(weights, step_metrics):
        metrics.append(step_metrics)

    return Trainer(
        TrainerConfig.model_validate(cfg.model_dump()), run_dir, ListSource(_batches()), sink, seed=0
    )


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("sharding", ["none", "zero1"])
async def test_the_trainer_loop_with_tp2_replicas_resized_and_parked_mid_step_equals_one_process(
    tmp_path, sharding
):
    # zero1: each TP rank's MasterAdamW shards its parameters over its DP group; the state goes to the
    # mirror (a MasterAdamW holding everything) when the last replica leaves, and back from it
    import asyncio

    reference_metrics: list[dict[str, float]] = []
    reference = _trainer(tmp_path / "ref", 1, reference_metrics)
    await reference.run(max_steps=NUM_STEPS)

    metrics: list[dict[str, float]] = []
    elastic = _trainer(tmp_path / "tp2", 2, metrics, sharding)
    sizes, waiting = [], []

    async def check(boundary: int) -> None:
        sizes.append(elastic.dp.size)
        assert elastic.tp is not None
        waiting.append(elastic.tp.waiting_devices)
        digests = await asyncio.to_thread(elastic.tp.replica_digests)
        for tp_rank in range(2):
            assert len({d[tp_rank] for d in digests}) == 1, f"replicas differ at boundary {boundary}"

    schedule = DeviceSchedule(elastic, TRAINER_SCHEDULE, check)
    try:
        await elastic.run(max_steps=NUM_STEPS)
    finally:
        await asyncio.to_thread(elastic.close)

    assert schedule.boundaries >= len(TRAINER_SCHEDULE), (
        "the schedule did not play out: too few micro-batches"
    )
    assert {1, 2} <= set(sizes) and waiting[0] == ["d2"]
    assert [m["grad_norm"] for m in metrics] == pytest.approx(
        [m["grad_norm"] for m in reference_metrics], rel=RTOL
    )
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in reference_metrics], rel=RTOL)
    expected = dict(reference.model.named_parameters())
    for name, value in elastic.model.named_parameters():  # the mirror: what is published and checkpointed
        torch.testing.assert_close(value.detach(), expected[name].detach(), rtol=RTOL, atol=ATOL, msg=name)
    assert elastic.state.step == NUM_STEPS and elastic.latest_weights.version == NUM_STEPS
