"""`gyre bench rollout --json`: executions on CPU torch engines while their devices are reassigned.

In one process: `--devices` logical devices each run a TorchEngine (the tiny gyre.model) behind
the Router; `--tasks x --group-size` longhorizon executions run through the agent loop, sampling
at `--temperature` (1 by default; 0 is greedy) with a seed per call (services/rollout/agent.py
`call_seed`), so a resumed generation must draw the same tokens it would have drawn unmoved; a
reassigner takes a device that has work in flight away (`remove_engine`:
drain -> migrate its generations) and gives it back a moment later (a fresh engine), until
`--reassignments` moves have happened and the executions are done. Afterwards every migrated
completion is generated again on ONE fresh engine with the same request, and `token_exact` is
true only if every one matches token for token (`logprobs_max_abs_diff` shows how close their
log-probs are). The whole run is repeated `--repeats` times with and without reassignments
(interleaved); throughput is the median with min and max beside, `token_exact` must hold in every
repeat.

Prints one JSON object (see `docs/rollout.md` for the fields).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import time
from typing import Any


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gyre bench rollout", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--devices", type=int, default=4, help="logical devices (engines), >= 3")
    p.add_argument("--tasks", type=int, default=8, help="longhorizon tasks")
    p.add_argument("--group-size", type=int, default=3, help="executions per task")
    p.add_argument("--reassignments", type=int, default=24, help="device reassignments to make, >= 20")
    p.add_argument("--max-tokens", type=int, default=12, help="tokens per LLM call")
    p.add_argument("--max-turns", type=int, default=40, help="longest horizon (turns)")
    p.add_argument("--gap-s", type=float, default=0.05, help="seconds a taken device stays away")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--repeats", type=int, default=3, help="runs with and without reassignments (medians)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


async def run_bench(args: argparse.Namespace, *, reassign: bool = True) -> dict[str, Any]:
    from gyre.model import ModelConfig
    from services.rollout.agent import Agent, AgentConfig, ExecutionSpec
    from services.rollout.engines.base import Completion, GenerationRequest
    from services.rollout.engines.torch_engine import TorchEngine
    from services.rollout.environments.longhorizon import LongHorizonFamily, LongHorizonSpec
    from services.rollout.router import Router
    from services.rollout.steps import MemoryStepSink

    cfg = ModelConfig.model_validate({})
    router = Router()
    counter = iter(range(1_000_000))

    async def new_engine(device: str) -> TorchEngine:
        engine = TorchEngine(f"{device}-e{next(counter)}", device, cfg, init_seed=args.seed)
        await engine.start()
        return engine

    devices = [f"cpu0-{i}" for i in range(args.devices)]
    for d in devices:
        await router.add_engine(await new_engine(d))

    migrated: list[tuple[GenerationRequest, Completion]] = []

    class Recording:
        async def generate(self, request: GenerationRequest) -> Completion:
            out = await router.generate(request)
            if out.num_migrations:
                migrated.append((request, out))
            return out

    family = LongHorizonFamily(LongHorizonSpec(min_turns=4, max_turns=args.max_turns, seed=args.seed))
    sink = MemoryStepSink()
    agent = Agent(
        Recording(),
        sink,
        AgentConfig(temperature=args.temperature, max_tokens=args.max_tokens, stop_token_ids=()),
    )
    specs = [
        ExecutionSpec("bench", t, f"{t}-g0", f"{t}-g0-e{k}", "longhorizon", seed=args.seed)
        for t in family.task_ids(args.tasks)
        for k in range(args.group_size)
    ]
    rng = random.Random(args.seed)
    reassigned = 0
    done = asyncio.Event()

    async def reassigner() -> None:
        nonlocal reassigned
        if not reassign:
            reassigned = args.reassignments
            return
        while reassigned < args.reassignments or not done.is_set():
            busy = [d for d, e in router.engines.items() if e.num_active > 0]
            if not busy:
                if done.is_set():
                    break
                await asyncio.sleep(0.01)
                continue
            device = rng.choice(busy)
            await router.remove_engine(device)  # REASSIGN: drain, migrate in-flight generations
            await asyncio.sleep(args.gap_s)  # the device serves the trainer for a moment
            await router.add_engine(await new_engine(device))  # GRANTED back to rollout
            reassigned += 1
            if reassigned >= args.reassignments and done.is_set():
                break

    t0 = time.perf_counter()
    mover = asyncio.create_task(reassigner())
    outcomes = await asyncio.gather(*(agent.run(s, family.make(s.task_id)) for s in specs))
    done.set()
    # Keep executions coming until the reassignment quota is met (each round is a fresh group).
    extra_round = 0
    while reassigned < args.reassignments:
        extra_round += 1
        more = [
            ExecutionSpec(
                "bench",
                s.task_id,
                f"{s.task_id}-g{extra_round}",
                f"{s.task_id}-g{extra_round}-e0",
                "longhorizon",
            )
            for s in specs[:: args.group_size]
        ]
        done.clear()
        outcomes += await asyncio.gather(*(agent.run(s, family.make(s.task_id)) for s in more))
        specs += more
        done.set()
    await mover
    wall_s = time.perf_counter() - t0

    reference = await new_engine("ref")
    exact, lp_diff = True, 0.0
    for req, out in migrated:
        again = await reference.generate(req)
        exact = exact and again.token_ids == out.token_ids
        if again.token_ids == out.token_ids and out.logprobs:
            lp_diff = max(lp_diff, max(abs(a - b) for a, b in zip(again.logprobs, out.logprobs, strict=True)))
    await reference.close()
    for d in list(router.engines):
        await router.remove_engine(d)

    from gyre.v1 import events_pb2

    E = events_pb2.ExecutionEvent
    tokens = sum(o.tokens_generated for o in outcomes)
    return {
        "devices": args.devices,
        "reassignments": reassigned,
        "executions_started": sum(1 for e in sink.executions if e.kind == E.KIND_STARTED),
        "executions_completed": sum(1 for o in outcomes if o.kind in (E.KIND_FINISHED, E.KIND_TRUNCATED)),
        "executions_interrupted": sum(1 for o in outcomes if o.kind == E.KIND_FAILED),
        "steps": len(sink.steps),
        "migrations": router.stats.migrations,
        "migrated_completions": len(migrated),
        "migrated_tokens_reprefilled": router.stats.migrated_tokens_reprefilled,
        "tokens_generated": tokens,
        "tokens_per_s": round(tokens / wall_s, 1),
        "wall_s": round(wall_s, 2),
        "token_exact": bool(exact and migrated),
        "logprobs_max_abs_diff": lp_diff,
        "temperature": args.temperature,
    }


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.devices < 3 or args.reassignments < 20:
        print("gyre bench rollout: need --devices >= 3 and --reassignments >= 20", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore")
    runs, plains = [], []
    for _ in range(max(1, args.repeats)):  # interleaved, so load on a shared machine hits both alike
        runs.append(asyncio.run(run_bench(args)))
        # The plain alternative, same workload and process: no device is ever taken away.
        plains.append(asyncio.run(run_bench(args, reassign=False)))
    result = runs[0]  # counts of the first repeat (the workload is the same in every repeat)
    rates = [r["tokens_per_s"] for r in runs]
    plain_rates = [p["tokens_per_s"] for p in plains]
    result.update(
        token_exact=all(r["token_exact"] for r in runs),
        executions_interrupted=sum(r["executions_interrupted"] for r in runs),
        logprobs_max_abs_diff=max(r["logprobs_max_abs_diff"] for r in runs),
        migrated_completions_checked=sum(r["migrated_completions"] for r in runs),
        repeats=len(runs),
        tokens_per_s=statistics.median(rates),
        tokens_per_s_min=min(rates),
        tokens_per_s_max=max(rates),
        tokens_per_s_without_reassignments=statistics.median(plain_rates),
        wall_s=statistics.median(r["wall_s"] for r in runs),
    )
    result["tokens_per_s_ratio_vs_without"] = round(
        result["tokens_per_s"] / max(result["tokens_per_s_without_reassignments"], 1e-9), 3
    )
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0 if result["executions_interrupted"] == 0 and result["token_exact"] else 1
