"""Run a function on N real gloo ranks (spawned processes) with Megatron's parallel state at a given
TP x CP, for the parallel tests to compare against the single-process (TP = CP = 1) reference
(`services.trainer.parallel_reference.reference_loss_and_grads`).

Each rank initialises torch.distributed (gloo, TCP rendezvous on a free local port), Megatron's
parallel state (`gyre.model.parallel.init_model_parallel`), builds the model in float64 from the
parent's full weights (`gyre.model.tp_shard.load_full_weights`; a case may name another dtype), computes the loss of the parent's
batch, backpropagates, sums the gradients over the CP group and gathers them to full shapes over the
TP group (`services.trainer.parallel_reference`: model_parallel_backward, gathered_loss_and_grads). Every rank writes what it computed to `<out>/rank<r>.pt`; the parent reads them back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from gyre.embedded.server import free_port
from services.trainer.parallel_reference import gathered_loss_and_grads, model_parallel_backward


def _rank_main(rank: int, world: int, port: int, tp: int, cp: int, job: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    from gyre.model import build_model, tree_logits
    from gyre.model.parallel import init_model_parallel
    from gyre.model.tp_shard import load_full_weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        layout = init_model_parallel(tp, cp)
        results: list[dict[str, Any]] = []
        for case in job["cases"]:
            # any seed: the weights are loaded
            dtype = case.get("dtype", torch.float64)
            model = build_model(case["cfg"], dtype=dtype, seed=rank + 7)
            load_full_weights(model, case["weights"])
            ref_model = None
            if case.get("ref_weights") is not None:
                ref_model = build_model(case["cfg"], dtype=dtype, seed=0).requires_grad_(False)
                load_full_weights(ref_model, case["ref_weights"])
            b = case["batch"]
            with torch.no_grad():  # the scoring path: full-vocabulary logits on every rank
                logits = tree_logits(
                    model, b.token_ids, b.position_ids, b.node_offsets, b.node_lengths, b.node_parents
                )
            local_loss, metrics = model_parallel_backward(model, b, case["settings"], ref_model)
            loss_sum, grads = gathered_loss_and_grads(model, local_loss)
            results.append(
                {
                    "loss": loss_sum,
                    "local_loss": local_loss,
                    "grads": grads,
                    "metrics": metrics,
                    "logits": logits,
                }
            )
        if "vocab" in job and cp == 1:
            results.append(_vocab_parallel_check(layout, job["vocab"]))
        torch.save({"layout": layout, "results": results}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _vocab_parallel_check(layout: Any, vocab: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Vocabulary-parallel chunked log-prob/entropy of full `hidden`/`weight`/`targets` on this rank's
    vocabulary rows, backpropagated with upstream gradients `g_logprob`/`g_entropy`; the weight's
    gradient gathered back to full shape."""
    import torch.distributed as dist

    from services.trainer.vocab_parallel import vocab_parallel_logprob_entropy

    hidden = vocab["hidden"].clone().requires_grad_(True)
    shard = vocab["weight"].chunk(layout.tp_size)[layout.tp_rank].clone().requires_grad_(True)
    logprob, entropy = vocab_parallel_logprob_entropy(
        hidden, shard, vocab["targets"], int(vocab["chunk_tokens"]), layout.tp_rank, layout.tp_group
    )
    ((logprob * vocab["g_logprob"]).sum() + (entropy * vocab["g_entropy"]).sum()).backward()
    assert shard.grad is not None and hidden.grad is not None
    pieces = [torch.empty_like(shard.grad) for _ in range(layout.tp_size)]
    dist.all_gather(pieces, shard.grad, group=layout.tp_group)
    return {
        "logprob": logprob.detach(),
        "entropy": entropy.detach(),
        "grad_hidden": hidden.grad,
        "grad_weight": torch.cat(pieces),
    }


def run_parallel(
    tp: int, cp: int, cases: list[dict[str, Any]], out: Path, vocab: dict[str, torch.Tensor] | None = None
) -> list[dict[str, Any]]:
    """Run every case (cfg, weights, batch, settings, ref_weights) on TP x CP gloo ranks, and with
    `vocab` the vocabulary-parallel check after them (its result is each rank's last); the saved
    results of every rank, in rank order."""
    world = tp * cp
    job: dict[str, Any] = {"cases": cases}
    if vocab is not None:
        job["vocab"] = vocab
    mp.spawn(_rank_main, args=(world, free_port(), tp, cp, job, str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
