"""An in-process RL loop over the real pieces, without NATS or Postgres (for tests and tuning).

    rollout:    longhorizon env + the rollout agent loop (context policy, sampling seeds)
                driving the torch engine (KV cache, continuous batching)
    trajectory: task trees, GRPO scoring + dedup (`score_group`), tree packing (`pack`)
    trainer:    `from_chunks` -> `train_on_shard` (PPO-clipped tree loss, AdamW, grad clip)
    weights:    `save_weights` -> engine `load_weights` (a new version every optimizer step)

A test may import several services (library code may not), so this driver lives under tests/.
Only the step sink is an in-memory list (`MemoryStepSink`): it stands in for the bus.
"""

from __future__ import annotations

import asyncio
import itertools
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gyre.model import ModelConfig, save_weights
from gyre.v1 import common_pb2, events_pb2
from services.rollout.agent import Agent, AgentConfig, ExecutionSpec
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.environments.longhorizon import LongHorizonFamily, LongHorizonSpec
from services.rollout.steps import MemoryStepSink
from services.trainer.batch import from_chunks
from services.trainer.config import TrainerConfig
from services.trainer.loop import build_replica, train_on_shard
from services.trajectory.core import progress_from_pb
from services.trajectory.grouping import score_group
from services.trajectory.packing import pack
from services.trajectory.scoring import Ending, Outcome, ProgressScorer
from services.trajectory.tree import TaskTree

_ENDINGS = {
    events_pb2.ExecutionEvent.KIND_FINISHED: Ending.FINISHED,
    events_pb2.ExecutionEvent.KIND_TRUNCATED: Ending.TRUNCATED,
    events_pb2.ExecutionEvent.KIND_FAILED: Ending.FAILED,
}


@dataclass
class LearningSettings:
    iterations: int = 12
    tasks_per_iteration: int = 8
    group_size: int = 8
    updates_per_iteration: int = 1
    lr: float = 1e-3
    clip_eps: float = 0.2
    temperature: float = 1.0
    max_turns: int = 16
    num_actions: int = 4
    context: str = "compaction"
    compact_every: int = 3
    keep_last_turns: int = 2
    max_tokens: int = 2
    init_std: float = 0.02
    seed: int = 0


@dataclass
class IterationReport:
    iteration: int
    mean_reward: float
    num_executions: int
    metrics: dict[str, float] = field(default_factory=dict)


async def run_learning(s: LearningSettings, work_dir: Path | None = None) -> list[IterationReport]:
    """Sample, score, pack, train, reload weights; one report (mean reward before the update) per iteration."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # same float summation order on every machine: a fixed seed gives one result
    try:
        return await _run_learning(s, work_dir)
    finally:
        torch.set_num_threads(threads)


async def _run_learning(s: LearningSettings, work_dir: Path | None) -> list[IterationReport]:
    torch.manual_seed(s.seed)
    tmp = tempfile.TemporaryDirectory() if work_dir is None else None
    out_dir = Path(tmp.name) if tmp else Path(work_dir)  # type: ignore[arg-type]
    cfg = TrainerConfig(lr=s.lr, clip_eps=s.clip_eps, model=ModelConfig(init_std=s.init_std))
    model, optimizer, ref_model, loss_settings = build_replica(cfg, seed=s.seed)
    engine = TorchEngine("engine-0", "device-0", cfg.model, max_batch=256, init_seed=s.seed)
    await engine.start()
    version = 0

    async def publish() -> None:
        nonlocal version
        version += 1
        path = out_dir / f"v{version:06d}.safetensors"
        digest = save_weights(model, path)
        await engine.load_weights(common_pb2.WeightVersion(version=version, uri=path.as_uri(), sha256=digest))

    await publish()  # the engine samples with exactly the trainer's initial weights
    family = LongHorizonFamily(LongHorizonSpec(num_actions=s.num_actions, max_turns=s.max_turns, seed=s.seed))
    agent_cfg = AgentConfig(
        temperature=s.temperature,
        max_tokens=s.max_tokens,
        max_context_tokens=1024,
        context=s.context,  # type: ignore[arg-type]
        compact_every=s.compact_every,
        keep_last_turns=s.keep_last_turns,
    )
    task_numbers = itertools.count()
    reports: list[IterationReport] = []
    try:
        for it in range(s.iterations):
            sink = MemoryStepSink()
            agent = Agent(engine, sink, agent_cfg)
            tasks = [family.task_ids(10_000)[next(task_numbers)] for _ in range(s.tasks_per_iteration)]
            specs = [
                ExecutionSpec("learn", t, f"{t}.g{it}", f"{t}.g{it}.e{k}", "longhorizon", seed=s.seed + it)
                for t in tasks
                for k in range(s.group_size)
            ]
            outcomes = await asyncio.gather(*(agent.run(sp, family.make(sp.task_id)) for sp in specs))
            rewards = [o.reward if o.reward is not None else o.progress.score() for o in outcomes]
            trees = {t: TaskTree(t) for t in tasks}
            for st in sink.steps:
                trees[st.task_id].insert_call(
                    st.execution_id,
                    st.call_seq,
                    np.asarray(st.prompt_token_ids),
                    np.asarray(st.completion_token_ids),
                    np.asarray(st.completion_logprobs, dtype=np.float32),
                    np.asarray(st.completion_versions),
                )
            ends = {ev.execution_id: ev for ev in sink.executions if ev.kind in _ENDINGS}
            scorer = ProgressScorer()
            groups = []
            for t in tasks:
                outs = {
                    eid: Outcome(
                        eid,
                        _ENDINGS[ev.kind],
                        ev.reward if ev.HasField("reward") else None,
                        progress_from_pb(ev.progress),
                    )
                    for eid, ev in ends.items()
                    if ev.task_id == t
                }
                groups.append(score_group(trees[t], f"{t}.g{it}", outs, scorer).group)
            batch = from_chunks(pack(trees, groups).chunks)
            metrics: dict[str, float] = {}
            for _ in range(s.updates_per_iteration):
                metrics = train_on_shard(
                    model, optimizer, batch, loss_settings, ref_model, cfg.grad_clip, lambda m: None
                )
            await publish()
            reports.append(IterationReport(it, float(np.mean(rewards)), len(outcomes), metrics))
    finally:
        await engine.close()
        if tmp:
            tmp.cleanup()
    return reports


def main() -> None:  # pragma: no cover - manual tuning aid
    import argparse
    import time

    p = argparse.ArgumentParser()
    for name, default in LearningSettings().__dict__.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = p.parse_args()
    s = LearningSettings(**vars(args))
    t0 = time.perf_counter()
    for r in asyncio.run(run_learning(s)):
        m = r.metrics
        print(
            f"iter {r.iteration:3d} reward {r.mean_reward:.3f} n={r.num_executions} "
            f"ratio {m.get('ratio_mean', 0):.3f} clip {m.get('clip_fraction', 0):.3f} "
            f"gn {m.get('grad_norm', 0):.4f} trained {m.get('num_trained_tokens', 0):.0f} "
            f"t={time.perf_counter() - t0:.1f}s",
            flush=True,
        )


if __name__ == "__main__":  # pragma: no cover
    main()
