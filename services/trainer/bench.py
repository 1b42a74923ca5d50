"""`gyre bench trainer --json`: one training step on a branching batch, tree-packed vs flat.

Flat = every root-to-leaf path as its own causal sample, trained as a flat trainer without tree
packing trains it: micro-batches of k paths (each path attends only to itself), gradients
accumulated, one AdamW step; k in --flat-micro-batch, and the fastest k is the baseline. Every
variant (forward + backward + AdamW step) runs in this process on a model with the same initial
weights, the variants interleaved step by step so that load on a shared machine hits them alike.
Printed: the median step time of each variant over --steps repeats (min and max beside), and
`step_speedup = flat_step_s / tree_step_s` (medians), to be read against
`token_ratio = flat_tokens / tree_tokens` (the work the packing removes); the goal is
step_speedup >= 0.8 x token_ratio. `loss_rel_diff` shows both compute the same loss.

`loss_memory` (unless --no-loss-memory): peak memory of the sampled-token loss (log-prob + entropy
over the output layer, forward + backward) for one large batch, full T x V logits vs chunked, each
in its own spawned process (services/trainer/loss_memory.py; bytes, seconds, ratio = full/chunked).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any


def flat_micro_batches(batch: Any, paths_per_micro_batch: int) -> list[Any]:
    """Every root-to-leaf path of `batch` as its own causal sample, `paths_per_micro_batch` samples
    per micro-batch (padding-free: each sample attends only to itself), as a flat trainer without
    tree packing trains: one forward + backward per micro-batch, gradients accumulated, one
    optimizer step. Per-path weights come from the benchmark's construction (one advantage per path).
    """
    import torch

    from gyre.model.attention import TreeLayout
    from services.trainer.batch import PackedBatch

    layout = TreeLayout(batch.num_tokens, batch.node_offsets, batch.node_lengths, batch.node_parents)
    paths = list(zip(layout.path_tokens(), batch.path_weights, strict=True))
    out = []
    for i in range(0, len(paths), paths_per_micro_batch):
        chunk = paths[i : i + paths_per_micro_batch]
        idx = torch.cat([p for p, _ in chunk])
        lengths = [len(p) for p, _ in chunk]
        fields = {
            name: getattr(batch, name)[idx]
            for name in ("token_ids", "position_ids", "loss_mask", "behaviour_logprobs", "policy_versions")
        }
        dtype = batch.weight_pos.dtype
        out.append(
            PackedBatch(
                f"{batch.batch_id}-flat{i}",
                node_offsets=[sum(lengths[:j]) for j in range(len(lengths))],
                node_lengths=lengths,
                node_parents=[-1] * len(lengths),
                weight_pos=torch.cat([torch.full((len(p),), max(w, 0.0)) for p, (w, _) in chunk]).to(dtype),
                weight_neg=torch.cat([torch.full((len(p),), min(w, 0.0)) for p, (w, _) in chunk]).to(dtype),
                kl_weight=torch.cat([torch.full((len(p),), n) for p, (_, n) in chunk]).to(dtype),
                **fields,
            )
        )
    return out


def branching_batch(prefix_len: int, num_branches: int, branch_len: int, depth: int, seed: int) -> Any:
    """A tree-packed batch: one prompt, branches (and sub-branches), one advantage per path."""
    import torch

    from gyre.model.attention import TreeLayout
    from gyre.model.forward import predecessor_index
    from gyre.model.trees import shared_prefix_tree
    from services.trainer.batch import PackedBatch

    rng = random.Random(seed)
    tree = shared_prefix_tree(prefix_len, num_branches, branch_len, depth)
    t = tree.num_tokens
    layout = TreeLayout(t, tree.node_offsets, tree.node_lengths, tree.node_parents)
    loss_mask = predecessor_index(layout) >= 0
    loss_mask[:prefix_len] = False  # the prompt is not trained
    w_pos, w_neg, kl_w = torch.zeros(t), torch.zeros(t), torch.zeros(t)
    path_weights = []
    for p in layout.path_tokens():
        adv, norm = rng.uniform(-1, 1), 1.0 / len(layout.paths())
        (w_pos if adv >= 0 else w_neg)[p] += adv * norm
        kl_w[p] += norm
        path_weights.append((adv * norm, norm))
    batch = PackedBatch(
        "bench",
        token_ids=torch.tensor([rng.randrange(512) for _ in range(t)]),
        position_ids=torch.tensor(tree.position_ids),
        node_offsets=tree.node_offsets,
        node_lengths=tree.node_lengths,
        node_parents=tree.node_parents,
        loss_mask=loss_mask,
        weight_pos=w_pos,
        weight_neg=w_neg,
        kl_weight=kl_w,
        behaviour_logprobs=torch.where(loss_mask, -6.2, 0.0),
        policy_versions=torch.where(loss_mask, 0, -1),
    )
    batch.path_weights = path_weights  # type: ignore[attr-defined]
    return batch


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from gyre.model import ModelConfig, build_model
    from services.trainer.loss import LossSettings, tree_loss

    loss_memory = None
    if not args.no_loss_memory:  # first: children spawned from a small parent, before the models
        from services.trainer.loss_memory import measure_loss_memory

        loss_memory = measure_loss_memory(
            args.loss_tokens,
            args.loss_vocab,
            args.loss_hidden,
            args.loss_chunk_tokens,
            device="cuda" if torch.cuda.is_available() else "cpu",
        )
    torch.set_num_threads(args.threads or torch.get_num_threads())
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.hidden // 32,
        ffn_hidden_size=4 * args.hidden,
    )
    tree = branching_batch(args.prefix_len, args.branches, args.branch_len, args.depth, args.seed)
    # The tree variant: one packed batch. Each flat variant: micro-batches of k paths; the baseline is
    # the fastest k (a flat trainer tuned as well as it can be on this machine).
    variants: dict[str, list[Any]] = {"tree": [tree]}
    for k in args.flat_micro_batch:
        variants[f"flat_mb{k}"] = flat_micro_batches(tree, k)
    settings = LossSettings(clip_eps=0.2)
    models = {name: build_model(cfg, seed=args.seed) for name in variants}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    first_loss: dict[str, float] = {}
    for step in range(args.steps + 1):  # step 0 is a warm-up, not timed
        for name, micro_batches in variants.items():  # interleaved, so load hits every variant alike
            start = time.perf_counter()
            optims[name].zero_grad(set_to_none=True)
            total = 0.0
            for mb in micro_batches:
                loss, _ = tree_loss(models[name], mb, settings)
                loss.backward()
                total += loss.item()
            optims[name].step()
            elapsed = time.perf_counter() - start
            if step == 0:
                first_loss[name] = total
            else:
                times[name].append(elapsed)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    flat_name = min((n for n in variants if n != "tree"), key=lambda n: medians[n])
    flat_tokens = sum(mb.num_tokens for mb in variants[flat_name])
    token_ratio = flat_tokens / tree.num_tokens
    speedup = medians[flat_name] / medians["tree"]
    result = {
        "tree_tokens": tree.num_tokens,
        "flat_tokens": flat_tokens,
        "token_ratio": round(token_ratio, 4),
        "num_paths": len(tree.path_weights),
        "flat_baseline": flat_name,
        "flat_micro_batches": len(variants[flat_name]),
        "tree_step_s": round(medians["tree"], 4),
        "flat_step_s": round(medians[flat_name], 4),
        "step_speedup": round(speedup, 4),
        "step_speedup_min": round(min(times[flat_name]) / max(times["tree"]), 4),
        "step_speedup_max": round(max(times[flat_name]) / min(times["tree"]), 4),
        "goal_step_speedup": round(0.8 * token_ratio, 4),
        "meets_goal": speedup >= 0.8 * token_ratio,
        "step_s": {name: _stats(ts) for name, ts in times.items()},
        "loss_tree": first_loss["tree"],
        "loss_flat": first_loss[flat_name],
        "loss_rel_diff": abs(first_loss["tree"] - first_loss[flat_name])
        / max(abs(first_loss[flat_name]), 1e-30),
        "model": {"layers": args.layers, "hidden": args.hidden, "attention_backend": cfg.attention_backend},
        "steps_timed": args.steps,
        "torch_threads": torch.get_num_threads(),
    }
    if loss_memory is not None:
        result["loss_memory"] = loss_memory
    return result


def loss_memory_line(m: dict[str, Any]) -> str:
    """`loss peak memory: full X GiB vs chunked Y GiB (Z x less)` from a `loss_memory` entry."""
    gib = 1024**3
    return (
        f"loss peak memory: full {m['full_peak_bytes'] / gib:.3f} GiB vs chunked "
        f"{m['chunked_peak_bytes'] / gib:.3f} GiB ({m['ratio']:.1f} x less); {m['tokens']} tokens x "
        f"{m['vocab']} vocab, chunks of {m['chunk_tokens']}, {m['method']}"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gyre bench trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    parser.add_argument("--prefix-len", type=int, default=384, help="prompt tokens shared by every path")
    parser.add_argument("--branches", type=int, default=8, help="branches under the prompt")
    parser.add_argument("--branch-len", type=int, default=64, help="tokens per branch node")
    parser.add_argument(
        "--depth", type=int, default=2, help="levels of branching (each deeper level splits in two)"
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument(
        "--steps",
        type=int,
        default=9,
        help="timed steps per variant (median reported, min and max beside; on a shared machine a "
        "load spike lands in one or two of them, which the median of nine leaves out)",
    )
    parser.add_argument(
        "--flat-micro-batch",
        type=int,
        nargs="+",
        default=[2, 4, 8, 16],
        help="paths per micro-batch of the flat trainer; the fastest is the baseline",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--seed", type=int, default=0)
    loss = parser.add_argument_group(
        "loss memory",
        "peak memory of log-prob + entropy over the output layer (forward + backward), full T x V "
        "logits vs chunked, each in a fresh process. The issue's shape, 32K tokens x 152K vocabulary, "
        "needs a GPU or ~40 GB of RAM for the full variant; pass --loss-tokens 32768 --loss-vocab "
        "151936 to measure it",
    )
    loss.add_argument("--loss-tokens", type=int, default=8192, help="tokens in the batch")
    loss.add_argument("--loss-vocab", type=int, default=32768, help="vocabulary size")
    loss.add_argument("--loss-hidden", type=int, default=256, help="hidden size")
    loss.add_argument("--loss-chunk-tokens", type=int, default=1024, help="tokens per chunk")
    loss.add_argument("--no-loss-memory", action="store_true", help="skip the loss memory measurement")
    args = parser.parse_args(argv)
    result = run(args)
    print(json.dumps(result))
    if not args.json and "loss_memory" in result:
        print(loss_memory_line(result["loss_memory"]))
    return 0
