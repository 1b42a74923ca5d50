"""Model-level tensor and context parallelism on two real ranks against one process, timed: the
model-parallel section of scripts/gpu_check.sh (`check_model_parallel`).

Two spawned processes (torch.multiprocessing), one GPU each with NCCL (`cuda:0`, `cuda:1`) or two CPU
processes with gloo (gpu_check's --allow-cpu smoke test), form one world of 2 (a TCPStore the caller
hosts, `services.trainer.rendezvous`) and run one layout after another, on the same batch and the same
full weights:

    tp1   TP = CP = 1, the reference: each rank runs the whole model on its own device (Megatron's
          state holds both as data-parallel replicas, unused); rank 0's numbers are reported
    tp2   TP = 2 (Megatron's split of heads, MLP width and vocabulary; vocabulary-parallel loss)
    cp2   CP = 2 (each rank trains the loss terms of half of the packed tokens; K/V all-gathered)

each in float32 and then in bfloat16 (parameters and batch in that dtype, as `trainer.dtype` does;
no fp32 masters here). The loss is the trainer's (`tree_loss`: PPO-clip, KL to a reference model,
entropy bonus), behaviour log-probs those of the float32 model (ratios near 1, far from the clip
bounds, where bf16 rounding could switch a token's gradient on or off).

Per layout and dtype:
    step_s              mean seconds of one forward + backward (`parallel_reference.
                        model_parallel_backward`, the CP gradient all-reduce included) over `steps`
                        after one warm-up step; the gather for the comparison is not timed
    loss_gap, grad_gap  to tp1 in the same dtype (`parallel_reference.relative_gaps`: relative loss
                        error, worst per-parameter relative gradient error in norm)
    loss_gap_fp32, grad_gap_fp32   bfloat16 only: to tp1 in float32; tp1's is bf16's own rounding
                        error, the floor the parallel layouts are judged against

Guarantees
- `within_tolerance` is true iff every float32 gap is below FP32_LOSS_TOL / FP32_GRAD_TOL and each
  parallel layout's bfloat16 gaps to float32 are at most max(BF16_SLACK x tp1's, BF16_LOSS_TOL /
  BF16_GRAD_TOL).
- `check_model_parallel` never raises for what happens in the ranks and returns within about
  `time_limit_s`: a rank's exception comes back as {"error": ...}; past the limit both ranks are
  killed and the result is {"error": "timed out ..."}. With NCCL and fewer than 2 GPUs the result is
  {"skipped": "<n> GPU(s); needs 2"}.
"""

from __future__ import annotations

import datetime
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from services.trainer.batch import PackedBatch
from services.trainer.loss import LossSettings
from services.trainer.rendezvous import LOCAL_HOST, host_store, join_store

WORLD = 2
LAYOUTS = (("tp1", 1, 1), ("tp2", 2, 1), ("cp2", 1, 2))
DTYPES = (torch.float32, torch.bfloat16)
FP32_LOSS_TOL, FP32_GRAD_TOL = 1e-4, 1e-3
BF16_SLACK, BF16_LOSS_TOL, BF16_GRAD_TOL = 2.0, 1e-3, 0.03
# The loss of the check: every term on (the entropy bonus uncapped, so it has a gradient).
SETTINGS = LossSettings(kl_coef=0.05, entropy_coef=0.01, entropy_target=None)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_main(
    rank: int, host: str, port: int, backend: str, job: dict[str, Any], out: str, timeout_s: float
) -> None:
    """One of the two ranks: every layout of LAYOUTS in turn, each dtype of DTYPES; rank 0 saves the
    report to `<out>/rank0.pt`."""
    import torch.distributed as dist

    from gyre.model import build_model
    from gyre.model.megatron import quiet_megatron_import
    from gyre.model.parallel import init_model_parallel
    from gyre.model.tp_shard import load_full_weights
    from services.trainer.loss import batch_logprobs
    from services.trainer.parallel_reference import (
        gathered_loss_and_grads,
        model_parallel_backward,
        relative_gaps,
    )

    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    quiet_megatron_import()
    from megatron.core import parallel_state

    store = join_store(host, port, timeout_s)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        cfg, steps = job["cfg"], int(job["steps"])
        report: dict[str, Any] = {}
        truth: dict[torch.dtype, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        full: dict[str, torch.Tensor] = {}
        ref_full: dict[str, torch.Tensor] = {}
        batch: PackedBatch = job["batch"].to(device, torch.float32)
        for label, tp, cp in LAYOUTS:
            init_model_parallel(tp, cp)
            if not full:  # tp1: the weights every layout loads, the same on both ranks (seeded)
                model = build_model(cfg, device, torch.float32, seed=job["seed"])
                ref = build_model(cfg, device, torch.float32, seed=job["seed"] + 1).requires_grad_(False)
                full = {n: p.detach().clone() for n, p in model.named_parameters()}
                ref_full = {n: p.detach().clone() for n, p in ref.named_parameters()}
                with torch.no_grad():
                    lp = batch_logprobs(model, batch, SETTINGS.chunk_tokens)
                dist.broadcast(lp, src=0)  # both ranks train on the very same batch
                batch.behaviour_logprobs = torch.where(batch.loss_mask, lp, torch.zeros_like(lp))
            else:  # any seed: the weights are loaded
                model = build_model(cfg, device, torch.float32, seed=0)
                ref = build_model(cfg, device, torch.float32, seed=0).requires_grad_(False)
            entries: dict[str, Any] = {}
            for dtype in DTYPES:
                model.to(dtype=dtype)
                ref.to(dtype=dtype)
                load_full_weights(model, full)  # bf16: the float32 weights rounded
                load_full_weights(ref, ref_full)
                b = batch.to(device, dtype)
                model.train()
                model_parallel_backward(model, b, SETTINGS, ref)  # warm-up (kernels compile)
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    local, metrics = model_parallel_backward(model, b, SETTINGS, ref)
                _sync(device)
                entry: dict[str, Any] = {"step_s": (time.perf_counter() - t0) / steps}
                loss, grads = gathered_loss_and_grads(model, local)
                entry["tokens_on_rank"] = int(metrics["num_tokens"])
                if label == "tp1":
                    truth[dtype] = (loss, grads)
                else:
                    entry["loss_gap"], entry["grad_gap"] = relative_gaps(*truth[dtype], loss, grads)
                if dtype != torch.float32:
                    entry["loss_gap_fp32"], entry["grad_gap_fp32"] = relative_gaps(
                        *truth[torch.float32], loss, grads
                    )
                entry["loss_finite"] = bool(torch.isfinite(loss).item())
                entries[_dtype_name(dtype)] = entry
                del grads
            report[label] = entries
            del model, ref
            if device.type == "cuda":
                torch.cuda.empty_cache()
            parallel_state.destroy_model_parallel()
        if rank == 0:
            torch.save(report, Path(out) / "rank0.pt")
    finally:
        dist.destroy_process_group()


def within_tolerance(report: dict[str, Any]) -> bool:
    """The module docstring's criterion over a report's layouts (tp1 and the parallel ones)."""
    ok = True
    floor = report["tp1"][_dtype_name(torch.bfloat16)]
    for label, _, _ in LAYOUTS[1:]:
        fp32 = report[label][_dtype_name(torch.float32)]
        bf16 = report[label][_dtype_name(torch.bfloat16)]
        ok &= fp32["loss_gap"] < FP32_LOSS_TOL and fp32["grad_gap"] < FP32_GRAD_TOL
        ok &= bf16["loss_gap_fp32"] <= max(BF16_SLACK * floor["loss_gap_fp32"], BF16_LOSS_TOL)
        ok &= bf16["grad_gap_fp32"] <= max(BF16_SLACK * floor["grad_gap_fp32"], BF16_GRAD_TOL)
        ok &= fp32["loss_finite"] and bf16["loss_finite"]
    return bool(ok)


def _stop(ctx: Any) -> None:
    """Kill the ranks this module spawned (those still alive) and reap them."""
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
    for proc in ctx.processes:
        proc.join(10)


def check_model_parallel(
    cfg: Any, batch: PackedBatch, *, backend: str, steps: int, time_limit_s: float, seed: int = 0
) -> dict[str, Any]:
    """Run the comparison (module docstring) on two spawned ranks with `backend` ("nccl": one GPU
    each; "gloo": CPU) and return the report: per layout and dtype its step time and gaps, plus
    `within_tolerance`, `backend`, `num_tokens`, `steps`, `elapsed_s`; or {"skipped"} / {"error"}."""
    if backend == "nccl" and torch.cuda.device_count() < WORLD:
        return {"skipped": f"{torch.cuda.device_count()} GPU(s); needs {WORLD}"}
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    started = time.monotonic()
    store = host_store(LOCAL_HOST, 0, time_limit_s)
    job = {"cfg": cfg, "batch": batch, "steps": steps, "seed": seed}
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.spawn(
            _rank_main,
            args=(LOCAL_HOST, store.port, backend, job, out, time_limit_s),
            nprocs=WORLD,
            join=False,
        )
        try:
            while not ctx.join(timeout=max(0.1, started + time_limit_s - time.monotonic())):
                if time.monotonic() >= started + time_limit_s:
                    _stop(ctx)
                    return {"error": f"timed out after {time_limit_s:.0f} s; the ranks were killed"}
        except Exception as exc:  # a rank raised or died: report it, the other rank is stopped
            _stop(ctx)
            return {"error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
        report: dict[str, Any] = torch.load(Path(out) / "rank0.pt", weights_only=False)
    report["within_tolerance"] = within_tolerance(report)
    report.update(
        backend=backend,
        world=WORLD,
        num_tokens=batch.num_tokens,
        steps=steps,
        elapsed_s=time.monotonic() - started,
    )
    return report
