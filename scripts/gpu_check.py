"""GPU readiness check (run by scripts/gpu_check.sh): prints one JSON object.

    1. the Megatron model on CUDA (tree attention picks flex attention there): trainer steps over a
       tree-packed batch, micro-batched -> train tokens/s
    2. NCCL data parallelism resized 1 -> 2 -> 1 at micro-batch boundaries, replicas compared
       bit for bit (skipped with one GPU)
    3. the torch inference engine on CUDA: concurrent generations -> decode tokens/s
    4. bf16 compute with fp32 master weights (trainer.precision bf16), alone, with recompute and with
       ZeRO-1 (one rank: its code path, unsharded), on batches like 1's -> step seconds, train
       tokens/s and MFU
       (MFU = 6 * parameters * tokens / step seconds / the device's dense bf16 peak; attention FLOPs
       are not counted, and recompute's extra forward is not credited: it is the model FLOPs
       utilisation, not the hardware's)
    5. model-level tensor and context parallelism on 2 GPUs (2 spawned ranks, NCCL, one GPU each):
       TP=2 and CP=2 forward+backward of the trainer's loss against TP=1/CP=1 on one GPU, same batch
       and weights, in fp32 and bf16 -> max relative loss and gradient gaps and step seconds of each
       (services/trainer/parallel_check.py; skipped with fewer than 2 GPUs). It gets what is left of
       --time-cap-s (gpu_check.sh's 480 s), at most MODEL_PARALLEL_MAX_S, and reports a timeout
       rather than being killed with the rest

`--xlong` runs only the trainer step of `gyre bench xlong`'s 1M point (app/bench/xlong_step.py): a
group of 8 executions reaching 1M tokens each (~17M tree tokens) packed as the trajectory service
packs it, then one optimizer step of this model (flex attention, micro-batches of
`--xlong-micro-tokens`, tree parts with their context) -> step seconds, loss finite, micro-batches,
peak memory. A 1M-token attention is out of reach on 2 CPU cores; with `--allow-cpu` it runs a
2K-token point as a smoke test.

The torch engine's close gives its cached CUDA memory back (reserved MiB before/after). vLLM has
its own section: `scripts/gpu_check.sh --vllm` (scripts/vllm_check.py). `--allow-cpu` runs the
same code on the CPU with small sizes (a smoke test of the script itself on a machine without a
GPU; its numbers say nothing about a GPU); section 5 then runs on gloo with 2 CPU processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STARTED = time.monotonic()  # before torch's import: the cap counts from the process start

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gyre.model.config import ModelConfig  # noqa: E402
from gyre.model.trees import random_tree  # noqa: E402
from services.trainer.batch import PackedBatch  # noqa: E402
from services.trainer.config import TrainerConfig  # noqa: E402
from services.trainer.loop import Trainer  # noqa: E402
from services.trainer.parallel_check import check_model_parallel  # noqa: E402

MODEL_PARALLEL_MAX_S = 240.0  # the model-parallel section's own limit (2 ranks start, compile, 6 runs)
PRINT_MARGIN_S = 20.0  # kept free of the cap for the JSON to be printed


def packed_batch(seed: int, num_nodes: int, max_len: int, num_roots: int, vocab: int) -> PackedBatch:
    """A random tree-packed batch (random tokens, advantages and behaviour log-probs)."""
    rng = random.Random(seed)
    tree = random_tree(rng, num_nodes, max_len=max_len, num_roots=num_roots)
    t = tree.num_tokens
    mask = torch.tensor([rng.random() < 0.7 for _ in range(t)])
    for offset in (tree.node_offsets[i] for i, p in enumerate(tree.node_parents) if p < 0):
        mask[offset] = False  # a root's first token has no predecessor
    w = torch.tensor([rng.uniform(-1, 1) for _ in range(t)], dtype=torch.float64)
    return PackedBatch(
        f"b{seed}",
        token_ids=torch.tensor([rng.randrange(vocab) for _ in range(t)]),
        position_ids=torch.tensor(tree.position_ids),
        node_offsets=tree.node_offsets,
        node_lengths=tree.node_lengths,
        node_parents=tree.node_parents,
        loss_mask=mask,
        weight_pos=w.clamp(min=0),
        weight_neg=w.clamp(max=0),
        kl_weight=torch.ones(t, dtype=torch.float64),
        behaviour_logprobs=torch.full((t,), -6.0, dtype=torch.float64) * mask,
        policy_versions=torch.where(mask, 0, -1),
        num_paths=num_roots,
    )


class Batches:
    def __init__(self, batches: list[PackedBatch]) -> None:
        self.batches = batches

    async def pull(self, current_version: int, resume_batch_id: str = "") -> PackedBatch | None:
        return self.batches.pop(0) if self.batches else None

    async def ack(self, batch_id: str, version: int) -> None:
        return None


async def check_training(device: str, model: ModelConfig, sizes: dict[str, int], out: dict[str, Any]) -> None:
    cfg = TrainerConfig(
        model=model,
        device="cuda" if device == "cuda" else "cpu",
        dtype="bfloat16" if device == "cuda" else "float32",
        micro_batch_tokens=sizes["micro_tokens"],
        checkpoint_every=1000,
        pull_wait_s=0,
    )
    steps = sizes["steps"]
    batches = [
        packed_batch(i, sizes["nodes"], sizes["node_len"], sizes["roots"], model.vocab_size)
        for i in range(steps + 3)
    ]
    metrics: list[dict[str, float]] = []

    async def sink(weights: Any, m: dict[str, float]) -> None:
        metrics.append(m)

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, Path(run_dir), Batches(batches), sink, seed=0)
        await trainer.run(max_steps=1)  # warm-up (kernels compile)
        sync(device)
        t0 = time.perf_counter()
        await trainer.run(max_steps=1 + steps)
        sync(device)
        elapsed = time.perf_counter() - t0
        tokens = sum(m["num_tokens"] for m in metrics[1:])
        out["train"] = {
            "device": str(next(trainer.model.parameters()).device),
            "tokens_per_step": tokens / steps,
            "micro_batches_per_step": metrics[-1]["num_micro_batches"],
            "train_tokens_per_s": tokens / elapsed,
            "loss_finite": all(torch.isfinite(torch.tensor(m["loss"])).item() for m in metrics),
        }
        if device == "cuda" and torch.cuda.device_count() > 1:
            trainer.device_index.update({"gpu-0": 0, "gpu-1": 1})
            sizes_seen, digests_equal = [], True
            for held in (["gpu-0"], ["gpu-0", "gpu-1"], ["gpu-0"]):
                trainer.set_devices(held)
                await asyncio.to_thread(trainer.dp.apply, True)
                sizes_seen.append(trainer.dp.size)
                if trainer.dp.size > 1:
                    await trainer.run(max_steps=trainer.state.step + 1)
                    digests = await asyncio.to_thread(trainer.dp.replica_digests)
                    digests_equal &= len(set(digests)) == 1
            out["nccl_resize"] = {"sizes": sizes_seen, "replicas_identical": digests_equal}
        else:
            out["nccl_resize"] = {"skipped": f"{torch.cuda.device_count()} GPU(s); needs 2"}
        trainer.close()


PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}  # dense, per GPU


def peak_tflops(override: float | None) -> float | None:
    """The device's dense bf16 peak (TFLOP/s): `override`, else by name; None when unknown."""
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


async def check_bf16_master(
    device: str, model: ModelConfig, sizes: dict[str, int], peak: float | None, out: dict[str, Any]
) -> None:
    """Step time, tokens/s and MFU of bf16 compute with fp32 masters (plus ZeRO-1 / recompute)."""
    results: dict[str, Any] = {}
    variants: list[tuple[str, dict[str, Any]]] = [
        ("bf16_master", {}),
        ("bf16_master_recompute", {"recompute_granularity": "full"}),
        ("bf16_master_zero1", {"optimizer_sharding": "zero1"}),
    ]
    for label, extra in variants:
        cfg = TrainerConfig(
            model=model,
            device="cuda" if device == "cuda" else "cpu",
            dtype="float32",
            precision="bf16",
            micro_batch_tokens=sizes["micro_tokens"],
            checkpoint_every=1000,
            pull_wait_s=0,
            **extra,
        )
        steps = sizes["steps"]
        batches = [
            packed_batch(i, sizes["nodes"], sizes["node_len"], sizes["roots"], model.vocab_size)
            for i in range(steps + 1)
        ]
        metrics: list[dict[str, float]] = []

        async def sink(weights: Any, m: dict[str, float], metrics: list[dict[str, float]] = metrics) -> None:
            metrics.append(m)

        with tempfile.TemporaryDirectory() as run_dir:
            trainer = Trainer(cfg, Path(run_dir), Batches(batches), sink, seed=0)
            await trainer.run(max_steps=1)  # warm-up
            sync(device)
            t0 = time.perf_counter()
            await trainer.run(max_steps=1 + steps)
            sync(device)
            elapsed = time.perf_counter() - t0
            num_params = sum(p.numel() for p in trainer.model.parameters())
            tokens = sum(m["num_tokens"] for m in metrics[1:])
            achieved = 6 * num_params * tokens / elapsed
            results[label] = {
                "step_s": elapsed / steps,
                "train_tokens_per_s": tokens / elapsed,
                "model_tflops_per_s": achieved / 1e12,
                "mfu": achieved / (peak * 1e12) if peak else None,
                "param_dtype": str(next(trainer.model.parameters()).dtype),
                "loss_finite": all(torch.isfinite(torch.tensor(m["loss"])).item() for m in metrics),
                "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
            }
            trainer.close()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
    results["peak_bf16_tflops"] = peak
    out["bf16_master"] = results


async def check_decode(device: str, model: ModelConfig, sizes: dict[str, int], out: dict[str, Any]) -> None:
    from services.rollout.engines.base import GenerationRequest, Sampling
    from services.rollout.engines.torch_engine import TorchEngine

    engine = TorchEngine(
        "check-e0",
        "gpu-0",
        model,
        torch_device="cuda:0" if device == "cuda" else "cpu",
        max_batch=sizes["batch"],
    )
    await engine.start()
    try:

        async def one(i: int) -> int:
            req = GenerationRequest(
                f"r{i}",
                [1 + (i * 7 + j) % 200 for j in range(32)],
                Sampling(1.0, sizes["new_tokens"], seed=i, stop_token_ids=()),
            )
            return len((await engine.generate(req)).token_ids)

        await asyncio.gather(*(one(i) for i in range(2)))  # warm-up
        sync(device)
        t0 = time.perf_counter()
        generated = await asyncio.gather(*(one(i) for i in range(sizes["batch"])))
        sync(device)
        out["decode"] = {
            "concurrent_requests": sizes["batch"],
            "tokens": sum(generated),
            "decode_tokens_per_s": sum(generated) / (time.perf_counter() - t0),
        }
    finally:
        reserved = torch.cuda.memory_reserved() if device == "cuda" else 0
        await engine.close()  # the device would go to training: its cached memory goes back
        if device == "cuda":
            out["engine_close"] = {
                "reserved_before_mib": reserved / 2**20,
                "reserved_after_mib": torch.cuda.memory_reserved() / 2**20,
            }


def check_parallel(
    device: str, model: ModelConfig, sizes: dict[str, int], cap_s: float, out: dict[str, Any]
) -> None:
    """Section 5: TP=2 and CP=2 against TP=1 on 2 ranks (NCCL on 2 GPUs; gloo on 2 CPU processes
    with --allow-cpu), within what is left of the cap."""
    left = cap_s - (time.monotonic() - STARTED) - PRINT_MARGIN_S
    limit = min(MODEL_PARALLEL_MAX_S, left)
    if device == "cuda" and torch.cuda.device_count() < 2:
        out["model_parallel"] = {"skipped": f"{torch.cuda.device_count()} GPU(s); needs 2"}
    elif limit < 30:
        out["model_parallel"] = {"skipped": f"{left:.0f} s left of the {cap_s:.0f} s cap; needs 30"}
    else:
        batch = packed_batch(1000, sizes["nodes"], sizes["node_len"], sizes["roots"], model.vocab_size)
        backend = "nccl" if device == "cuda" else "gloo"
        result = check_model_parallel(model, batch, backend=backend, steps=sizes["steps"], time_limit_s=limit)
        result["model"] = model.model_dump(include={"num_layers", "hidden_size", "vocab_size"})
        out["model_parallel"] = result


def check_xlong(device: str, args: argparse.Namespace) -> int:
    """The trainer step of `gyre bench xlong`'s 1M point (module docstring, --xlong)."""
    from app.bench.xlong_step import point_batch, train_point

    context, micro = args.xlong_context, args.xlong_micro_tokens
    if device == "cpu":  # smoke test of this section: a 2K-token point, tiny model
        context, micro = min(context, 2_000), min(micro, 4_096)
    model = ModelConfig(
        num_layers=4 if device == "cuda" else 1,
        hidden_size=512 if device == "cuda" else 32,
        num_attention_heads=8 if device == "cuda" else 2,
        vocab_size=512,
        max_position_embeddings=context + 8192,
    )
    t0 = time.perf_counter()
    batch = point_batch(context)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (smoke test)"
    }
    out["xlong"] = {"context_tokens": context, "build_s": round(time.perf_counter() - t0, 1)}
    out["xlong"].update(train_point(batch, model, device, micro))
    out["ok"] = bool(out["xlong"]["loss_finite"])
    print(json.dumps(out, indent=2))
    return 0 if out["ok"] else 1


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


async def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--allow-cpu", action="store_true", help="smoke-test on the CPU when no GPU is present"
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense bf16 peak for MFU (default: by name)",
    )
    parser.add_argument(
        "--time-cap-s",
        type=float,
        default=480.0,
        help="the wall-clock cap the whole run is under (gpu_check.sh's timeout); the model-parallel "
        "section uses what is left of it",
    )
    parser.add_argument(
        "--xlong", action="store_true", help="only the trainer step of the 1M-token point (module docstring)"
    )
    parser.add_argument("--xlong-context", type=int, default=1_000_000, help="tokens each execution reaches")
    parser.add_argument("--xlong-micro-tokens", type=int, default=131_072, help="micro-batch budget (tokens)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print(json.dumps({"ok": False, "error": "no CUDA device (use --allow-cpu for a smoke test)"}))
        return 2
    device = "cuda" if cuda else "cpu"
    if args.xlong:
        return check_xlong(device, args)
    if cuda:
        model = ModelConfig(
            num_layers=8,
            hidden_size=1024,
            num_attention_heads=16,
            vocab_size=32000,
            max_position_embeddings=4096,
        )
        train = {"nodes": 64, "node_len": 96, "roots": 8, "micro_tokens": 2048, "steps": 5}
        decode = {"batch": 64, "new_tokens": 128}
        # section 5: half the layers, one micro-batch's worth of tokens, a few steps (time cap)
        parallel_model = model.model_copy(update={"num_layers": 4})
        parallel = {"nodes": 32, "node_len": 64, "roots": 4, "steps": 3}
    else:
        model = ModelConfig()
        train = {"nodes": 16, "node_len": 6, "roots": 4, "micro_tokens": 24, "steps": 2}
        decode = {"batch": 4, "new_tokens": 8}
        parallel_model, parallel = model, {"nodes": 16, "node_len": 6, "roots": 4, "steps": 1}
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (smoke test: numbers say nothing)",
        "num_gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "model": model.model_dump(include={"num_layers", "hidden_size", "num_attention_heads", "vocab_size"}),
    }
    await check_training(device, model, train, out)
    await check_decode(device, model, decode, out)
    await check_bf16_master(device, model, train, peak_tflops(args.peak_tflops), out)
    check_parallel(device, parallel_model, parallel, args.time_cap_s, out)
    masters_ok = all(v["loss_finite"] for k, v in out["bf16_master"].items() if isinstance(v, dict))
    parallel_ok = "error" not in out["model_parallel"] and out["model_parallel"].get("within_tolerance", True)
    out["ok"] = (
        bool(out["train"]["loss_finite"])
        and out["nccl_resize"].get("replicas_identical", True)
        and masters_ok
        and parallel_ok
    )
    print(json.dumps(out, indent=2))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
