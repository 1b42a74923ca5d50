"""`gyre bench trainer --json`: one training step on a branching batch, tree-packed vs flat.

Flat = every root-to-leaf path as its own causal sample (what a trainer without tree packing
trains). Both steps (forward + backward + AdamW step) run in this process on models with the same
initial weights; the printed ratio `step_speedup = flat_step_s / tree_step_s` is what the packing
buys, to be read against `flat_tokens / tree_tokens` (the work it removes).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any


def flat_batch(batch: Any) -> Any:
    """Every root-to-leaf path of `batch` as its own single-node tree, weights split by path sign."""
    import torch

    from gyre.model.attention import TreeLayout
    from services.trainer.batch import PackedBatch

    layout = TreeLayout(batch.num_tokens, batch.node_offsets, batch.node_lengths, batch.node_parents)
    paths = layout.path_tokens()
    idx = torch.cat(paths)
    lengths = [len(p) for p in paths]
    offsets = [sum(lengths[:i]) for i in range(len(paths))]
    # Per-path weights are recovered from the benchmark's construction: one advantage per path.
    fields = {
        name: getattr(batch, name)[idx]
        for name in ("token_ids", "position_ids", "loss_mask", "behaviour_logprobs", "policy_versions")
    }
    w_pos, w_neg, kl_w = [], [], []
    for p, (w, norm) in zip(paths, batch.path_weights, strict=True):
        w_pos.append(torch.full((len(p),), max(w, 0.0)))
        w_neg.append(torch.full((len(p),), min(w, 0.0)))
        kl_w.append(torch.full((len(p),), norm))
    return PackedBatch(
        batch.batch_id + "-flat",
        node_offsets=offsets,
        node_lengths=lengths,
        node_parents=[-1] * len(paths),
        weight_pos=torch.cat(w_pos).to(batch.weight_pos.dtype),
        weight_neg=torch.cat(w_neg).to(batch.weight_pos.dtype),
        kl_weight=torch.cat(kl_w).to(batch.weight_pos.dtype),
        **fields,
    )


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from gyre.model import ModelConfig, build_model
    from services.trainer.loss import LossSettings, tree_loss

    torch.set_num_threads(args.threads or torch.get_num_threads())
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.hidden // 32,
        ffn_hidden_size=4 * args.hidden,
    )
    tree = branching_batch(args.prefix_len, args.branches, args.branch_len, args.depth, args.seed)
    flat = flat_batch(tree)
    settings = LossSettings(clip_eps=0.2)
    models = {name: build_model(cfg, seed=args.seed) for name in ("tree", "flat")}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    batches = {"tree": tree, "flat": flat}
    times: dict[str, list[float]] = {"tree": [], "flat": []}
    first_loss: dict[str, float] = {}
    for step in range(args.steps + 1):  # step 0 is a warm-up, not timed
        for name in ("tree", "flat"):
            start = time.perf_counter()
            loss, _ = tree_loss(models[name], batches[name], settings)
            optims[name].zero_grad(set_to_none=True)
            loss.backward()
            optims[name].step()
            elapsed = time.perf_counter() - start
            if step == 0:
                first_loss[name] = float(loss)
            else:
                times[name].append(elapsed)
    # The fastest of the interleaved repeats: on a shared machine, other load only ever adds time,
    # so the minimum is the least noisy estimate of each variant's own cost (medians also printed).
    tree_s, flat_s = min(times["tree"]), min(times["flat"])
    token_ratio = flat.num_tokens / tree.num_tokens
    return {
        "tree_tokens": tree.num_tokens,
        "flat_tokens": flat.num_tokens,
        "token_ratio": round(token_ratio, 4),
        "num_paths": len(tree.path_weights),
        "tree_step_s": round(tree_s, 4),
        "flat_step_s": round(flat_s, 4),
        "step_speedup": round(flat_s / tree_s, 4),
        "goal_step_speedup": round(0.8 * token_ratio, 4),
        "meets_goal": flat_s / tree_s >= 0.8 * token_ratio,
        "loss_tree": first_loss["tree"],
        "loss_flat": first_loss["flat"],
        "loss_rel_diff": abs(first_loss["tree"] - first_loss["flat"]) / max(abs(first_loss["flat"]), 1e-30),
        "model": {"layers": args.layers, "hidden": args.hidden, "attention_backend": cfg.attention_backend},
        "tree_step_s_median": round(statistics.median(times["tree"]), 4),
        "flat_step_s_median": round(statistics.median(times["flat"]), 4),
        "steps_timed": args.steps,
        "torch_threads": torch.get_num_threads(),
    }


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
        "--steps", type=int, default=5, help="timed steps per variant (fastest reported, median too)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = run(args)
    print(json.dumps(result))
    return 0
