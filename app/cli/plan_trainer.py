"""`gyre plan trainer`: memory plan of one trainer device (services/trainer/memory_plan.py): the whole
replica, or with --tp / --cp one of its TP x CP ranks.

    gyre plan trainer --model examples/models/llama-7b.yaml --tokens 32768
    gyre plan trainer --model examples/models/llama-7b.yaml --tokens 1048576 --recompute \
        --loss-chunk-tokens 4096 --dp 8 --shard-optimizer --json
    gyre plan trainer --model examples/models/llama-7b.yaml --tokens 1048576 --recompute \
        --loss-chunk-tokens 4096 --tp 8 --cp 8

Prints params, grads, optimizer states, the KL reference (--kl-reference), activations, loss, total and the device size in GiB and
FITS / DOES NOT FIT. Exit code 0 when it fits, 1 when not (with the remedies that would help and the
total each would give), 2 on bad arguments. Pure arithmetic: no torch import, no model is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import yaml

from gyre.model.config import ModelConfig
from services.trainer.memory_plan import GIB, MemoryPlan, plan_memory


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gyre plan trainer", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, help="YAML mapping of ModelConfig fields; default: the tiny model"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        required=True,
        help="tokens of one micro-batch on one replica (split over its --cp ranks)",
    )
    parser.add_argument("--device-gib", type=float, default=80.0, help="device memory (GiB, default 80)")
    parser.add_argument(
        "--dtype", choices=["bf16", "fp32"], default="bf16", help="parameter/activation dtype"
    )
    parser.add_argument(
        "--no-fp32-master", action="store_true", help="bf16 params without an fp32 master copy"
    )
    parser.add_argument(
        "--recompute", action="store_true", help="keep only layer inputs, recompute in backward"
    )
    parser.add_argument(
        "--loss-chunk-tokens", type=int, default=None, help="chunked loss; default: full loss"
    )
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size")
    parser.add_argument("--shard-optimizer", action="store_true", help="shard Adam states over the DP group")
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor parallel size: weights, grads, optimizer and heads split"
    )
    parser.add_argument(
        "--cp", type=int, default=1, help="context parallel size: each rank holds --tokens / CP tokens"
    )
    parser.add_argument(
        "--kl-reference", action="store_true", help="count the KL reference model (bf16; kl_coef > 0)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def load_model(path: Path | None) -> ModelConfig:
    """A ModelConfig from a YAML mapping (a `model:` key is also accepted), or the defaults."""
    if path is None:
        return ModelConfig()
    data = yaml.safe_load(path.read_text()) or {}
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        data = data["model"]
    return ModelConfig.model_validate(data)


def remedies(model: ModelConfig, plan: MemoryPlan) -> list[tuple[str, MemoryPlan]]:
    """Changes that would lower the total, each with the plan it gives (cumulative, cheapest first)."""
    out: list[tuple[str, MemoryPlan]] = []
    current = plan

    def step(label: str, **change: object) -> None:
        nonlocal current
        fields = {
            k: getattr(current, k)
            for k in ("tokens", "param_dtype", "fp32_master", "dp_size", "shard_optimizer")
            + ("recompute", "loss_chunk_tokens", "device_bytes", "kl_reference", "tp_size", "cp_size")
        }
        fields.update(change)
        current = plan_memory(model, **fields)  # type: ignore[arg-type]
        out.append((label, current))

    if not plan.recompute:
        step("--recompute (keep only layer inputs)", recompute=True)
    if plan.loss_chunk_tokens is None or plan.loss_chunk_tokens > 4096:
        if plan.tokens > 4096:
            step("--loss-chunk-tokens 4096 (chunk the loss)", loss_chunk_tokens=4096)
    if not plan.shard_optimizer or plan.dp_size < 8:
        dp = max(8, plan.dp_size)
        step(f"--dp {dp} --shard-optimizer (shard the optimizer over DP)", dp_size=dp, shard_optimizer=True)
    return out


def max_tokens_that_fit(model: ModelConfig, plan: MemoryPlan) -> int:
    """Largest micro-batch (tokens) that fits with `plan`'s other settings; 0 when none does."""
    lo, hi = 0, plan.tokens

    def fits(tokens: int) -> bool:
        return plan_memory(
            model,
            tokens=tokens,
            param_dtype=plan.param_dtype,
            fp32_master=plan.fp32_master,
            dp_size=plan.dp_size,
            shard_optimizer=plan.shard_optimizer,
            recompute=plan.recompute,
            loss_chunk_tokens=plan.loss_chunk_tokens,
            device_bytes=plan.device_bytes,
            kl_reference=plan.kl_reference,
            tp_size=plan.tp_size,
            cp_size=plan.cp_size,
        ).fits

    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        model = load_model(args.model)
        plan = plan_memory(
            model,
            tokens=args.tokens,
            param_dtype=args.dtype,
            fp32_master=not args.no_fp32_master,
            dp_size=args.dp,
            shard_optimizer=args.shard_optimizer,
            recompute=args.recompute,
            loss_chunk_tokens=args.loss_chunk_tokens,
            device_bytes=int(args.device_gib * GIB),
            kl_reference=args.kl_reference,
            tp_size=args.tp,
            cp_size=args.cp,
        )
    except (OSError, ValueError) as exc:
        print(f"gyre plan trainer: {exc}", file=sys.stderr)
        return 2
    fixes = [] if plan.fits else remedies(model, plan)
    if args.json:
        doc = plan.as_dict()
        doc["remedies"] = [{"change": label, "total": p.total, "fits": p.fits} for label, p in fixes]
        print(json.dumps(doc, indent=2))
        return 0 if plan.fits else 1
    settings = {k: v for k, v in dataclasses.asdict(plan).items() if k not in dict(plan.rows())}
    print(f"model: {args.model or 'ModelConfig defaults'}, {plan.parameter_count / 1e9:.3f}B parameters")
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items() if k != "parameter_count"))
    print(f"{'part':<12} {'GiB':>10}")
    for name, value in plan.rows():
        print(f"{name:<12} {_gib(value):>10}")
    if plan.fits:
        print(
            f"FITS ({_gib(plan.device_bytes - plan.total)} GiB left; fragmentation, CUDA context, NCCL not counted)"
        )
        return 0
    print(f"DOES NOT FIT: {_gib(plan.total - plan.device_bytes)} GiB over. To change, in order:")
    for label, p in fixes:
        print(f"  {label}: total {_gib(p.total)} GiB -> {'fits' if p.fits else 'still over'}")
    if not fixes or not fixes[-1][1].fits:
        best = max_tokens_that_fit(model, fixes[-1][1] if fixes else plan)
        room = (
            f"at most {best:,} tokens per replica fit with the above" if best else "even 1 token does not fit"
        )
        print(
            f"  more devices: {room}; split the micro-batch over a larger DP group, a single longer "
            "sequence over --cp ranks, the weights over --tp ranks, or use a bigger device"
        )
    return 1


if __name__ == "__main__":
    sys.exit(main())
