"""Gyre's RL algorithm on one screen: the real pieces in one process, without NATS or Postgres.

    rollout:    longhorizon env + the rollout agent loop (context policy, sampling seeds)
                driving the torch engine (KV cache, continuous batching)
    trajectory: task trees, scoring + credit assignment + dedup (`score_group`), tree packing (`pack`)
    trainer:    `from_chunks` -> `train_batch` (services/trainer/step.py, the trainer's own step
                functions: clip-higher PPO tree loss over batch-normalised advantages + entropy
                bonus, micro-batches, AdamW)
    weights:    `save_weights` -> engine `load_weights` (a new version every optimizer step)

The distributed run (`gyre run examples/quickstart.yaml`) does the same with every part its own
service: the step sink is the NATS step stream there and an in-memory list here
(`MemoryStepSink`, the only stand-in). Like the quickstart, iterations cycle through a pool of
`num_tasks` tasks (with `--num-tasks 0` every iteration samples fresh tasks, so the policy must
learn the task *family*: cue -> action). Run it:

    .venv/bin/python examples/rl_loop.py --iterations 100 --seed 1

It prints, per iteration: mean reward (before the update) and the oracle's, the fraction of groups
with zero reward variance (no learning signal), and the trainer's entropy / KL / clip fraction.
tests/e2e/test_learning_in_process.py runs `run_learning` and checks that the policy learns.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gyre.model import ModelConfig, save_weights
from gyre.v1 import common_pb2, events_pb2
from services.rollout.agent import Agent, AgentConfig, ExecutionOutcome, ExecutionSpec
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.environments.longhorizon import LongHorizonFamily, LongHorizonSpec
from services.rollout.steps import MemoryStepSink
from services.trainer.batch import from_chunks
from services.trainer.config import TrainerConfig
from services.trainer.step import build_replica, train_batch
from services.trajectory.grouping import GroupResult, score_group
from services.trajectory.packing import pack
from services.trajectory.scoring import Ending, Outcome, ProgressScorer, ProgressSignals
from services.trajectory.tree import TaskTree

_ENDINGS = {
    events_pb2.ExecutionEvent.KIND_FINISHED: Ending.FINISHED,
    events_pb2.ExecutionEvent.KIND_TRUNCATED: Ending.TRUNCATED,
    events_pb2.ExecutionEvent.KIND_FAILED: Ending.FAILED,
}


@dataclass
class LearningSettings:
    """The quickstart's settings (examples/quickstart.yaml), one iteration = one trainer step."""

    iterations: int = 40
    tasks_per_iteration: int = 4  # groups per step (quickstart: rollout.groups_per_version)
    num_tasks: int = 4  # task pool, cycled (quickstart: rollout.num_tasks); 0 = fresh tasks every time
    group_size: int = 8
    lr: float = 3e-3
    clip_eps: float = 0.2
    clip_eps_high: float = 0.28
    entropy_coef: float = 0.3  # quickstart: trainer.entropy_coef (weighs against unit-RMS advantages)
    entropy_target: float = 0.5  # nats; < 0: no floor
    normalise_std: int = 0  # GRPO's division by the group's reward std (quickstart: off)
    batch_norm: int = 1  # trainer.normalise_batch_advantages: PG term / the batch's advantage RMS
    credit: str = "progress"  # trajectory.credit_assignment: "execution" | "progress" | "tree"
    progress_discount: float = 0.0  # trajectory.progress_discount
    tree_local_coef: float = 1.0  # trajectory.tree_local_coef
    tree_global_coef: float = 0.0  # trajectory.tree_global_coef
    temperature: float = 1.0
    max_turns: int = 8
    num_actions: int = 4
    context: str = "compaction"
    compact_every: int = 3
    keep_last_turns: int = 2
    max_tokens: int = 1
    init_std: float = 0.2  # quickstart: trainer.model.init_std
    seed: int = 0


@dataclass
class IterationReport:
    iteration: int
    mean_reward: float  # executions of this iteration, sampled before its update
    oracle_reward: float  # what a perfect policy gets on the same tasks (the environment says)
    zero_variance_fraction: float  # groups whose executions all scored alike (zero advantages)
    num_executions: int
    metrics: dict[str, float] = field(default_factory=dict)  # the trainer step's (entropy, kl, ...)


async def run_learning(
    s: LearningSettings,
    work_dir: Path | None = None,
    on_report: Callable[[IterationReport], None] | None = None,
) -> list[IterationReport]:
    """Sample, score, pack, train, reload weights; one report per iteration (deterministic per seed)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # same float summation order on every machine: a fixed seed gives one result
    torch.manual_seed(s.seed)
    cfg = TrainerConfig(
        lr=s.lr,
        clip_eps=s.clip_eps,
        clip_eps_high=s.clip_eps_high,
        entropy_coef=s.entropy_coef,
        entropy_target=s.entropy_target if s.entropy_target >= 0 else None,
        normalise_batch_advantages=bool(s.batch_norm),
        model=ModelConfig(init_std=s.init_std),
    )
    model, optimizer, ref_model, loss_settings = build_replica(cfg, seed=s.seed)
    engine = TorchEngine("engine-0", "device-0", cfg.model, max_batch=256, init_seed=s.seed)
    family = LongHorizonFamily(LongHorizonSpec(num_actions=s.num_actions, max_turns=s.max_turns, seed=s.seed))
    agent_cfg = AgentConfig(
        temperature=s.temperature,
        max_tokens=s.max_tokens,
        max_context_tokens=1024,
        context=s.context,  # type: ignore[arg-type]
        compact_every=s.compact_every,
        keep_last_turns=s.keep_last_turns,
    )
    pool = family.task_ids(s.num_tasks or 100_000)
    task_ids = itertools.cycle(pool) if s.num_tasks else iter(pool)
    reports: list[IterationReport] = []
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(work_dir or tmp)
        await engine.start()
        try:
            await publish_weights(model, engine, out_dir, version=0)  # the engine samples the trainer's init
            for it in range(s.iterations):
                tasks = list(itertools.islice(task_ids, s.tasks_per_iteration))
                sink, outcomes = await sample_groups(engine, agent_cfg, family, tasks, it, s)
                trees = build_trees(tasks, sink)
                groups = score_groups(tasks, trees, sink, it, s)
                batch = from_chunks(pack(trees, [g.group for g in groups]).chunks)
                metrics = train_batch(
                    model, optimizer, batch, loss_settings, ref_model, cfg.grad_clip, cfg.micro_batch_tokens
                )
                await publish_weights(model, engine, out_dir, version=it + 1)
                reports.append(iteration_report(it, outcomes, sink, groups, metrics))
                if on_report is not None:
                    on_report(reports[-1])
        finally:
            await engine.close()
            torch.set_num_threads(threads)
    return reports


async def sample_groups(
    engine: TorchEngine,
    agent_cfg: AgentConfig,
    family: LongHorizonFamily,
    tasks: list[str],
    iteration: int,
    s: LearningSettings,
) -> tuple[MemoryStepSink, list[ExecutionOutcome]]:
    """Run `group_size` executions of every task concurrently (one engine, continuous batching)."""
    sink = MemoryStepSink()
    agent = Agent(engine, sink, agent_cfg)
    specs = [
        ExecutionSpec(
            "learn", t, f"{t}.g{iteration}", f"{t}.g{iteration}.e{k}", "longhorizon", seed=s.seed + iteration
        )
        for t in tasks
        for k in range(s.group_size)
    ]
    outcomes = await asyncio.gather(*(agent.run(sp, family.make(sp.task_id)) for sp in specs))
    return sink, list(outcomes)


def build_trees(tasks: list[str], sink: MemoryStepSink) -> dict[str, TaskTree]:
    """Every LLM call attached at its deepest matching node of its task's tree (branches kept)."""
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
    return trees


def score_groups(
    tasks: list[str], trees: dict[str, TaskTree], sink: MemoryStepSink, iteration: int, s: LearningSettings
) -> list[GroupResult]:
    """Scores (final reward or partial progress), per-call advantages (``s.credit``: from the progress
    each call's step reported, as the trajectory service keeps it) and dedup, one group per task."""
    ends = {ev.execution_id: ev for ev in sink.executions if ev.kind in _ENDINGS}
    scorer = ProgressScorer()
    results = []
    for t in tasks:
        outcomes = {
            eid: Outcome(
                eid,
                _ENDINGS[ev.kind],
                ev.reward if ev.HasField("reward") else None,
                signals(ev.progress),
            )
            for eid, ev in ends.items()
            if ev.task_id == t
        }
        progress: dict[str, dict[int, ProgressSignals]] = {}
        for st in sink.steps:
            if st.task_id == t:
                progress.setdefault(st.execution_id, {})[st.call_seq] = signals(st.progress)
        results.append(
            score_group(
                trees[t],
                f"{t}.g{iteration}",
                outcomes,
                scorer,
                normalise_std=bool(s.normalise_std),
                credit=s.credit,  # type: ignore[arg-type]
                tree_local_coef=s.tree_local_coef,
                tree_global_coef=s.tree_global_coef,
                step_progress=progress,
                progress_discount=s.progress_discount,
            )
        )
    return results


def signals(p: common_pb2.ProgressSignal) -> ProgressSignals:
    """The progress an execution event carries, as the scorer reads it."""
    tests = p.tests_passed_fraction if p.HasField("tests_passed_fraction") else None
    return ProgressSignals(p.milestones_reached, p.milestones_total, tests, dict(p.extra))


async def publish_weights(model: torch.nn.Module, engine: TorchEngine, out_dir: Path, version: int) -> None:
    """safetensors + sha256, then a hot swap in the engine (as a WeightsPublishedEvent does)."""
    path = out_dir / f"v{version:06d}.safetensors"
    digest = save_weights(model, path)
    await engine.load_weights(common_pb2.WeightVersion(version=version, uri=path.as_uri(), sha256=digest))


def iteration_report(
    it: int,
    outcomes: list[ExecutionOutcome],
    sink: MemoryStepSink,
    groups: list[GroupResult],
    metrics: dict[str, float],
) -> IterationReport:
    rewards = [o.reward if o.reward is not None else o.progress.score() for o in outcomes]
    oracle = [ev.progress.extra["oracle_reward"] for ev in sink.executions if ev.kind in _ENDINGS]
    zero_var = sum(1 for g in groups if g.stats.std <= 1e-9) / max(len(groups), 1)
    return IterationReport(
        it, float(np.mean(rewards)), float(np.mean(oracle)), zero_var, len(outcomes), metrics
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(LearningSettings):
        default = getattr(LearningSettings(), f.name)
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default)
    s = LearningSettings(**vars(p.parse_args()))
    t0 = time.perf_counter()

    def show(r: IterationReport) -> None:
        m = r.metrics
        print(
            f"iter {r.iteration:3d} reward {r.mean_reward:.3f} oracle {r.oracle_reward:.2f} "
            f"zero-var {r.zero_variance_fraction:.2f} entropy {m.get('entropy', 0):.3f} "
            f"kl {m.get('kl_behaviour', 0):.4f} clip {m.get('clip_fraction', 0):.3f} "
            f"grad-norm {m.get('grad_norm', 0):.3f}",
            flush=True,
        )

    reports = asyncio.run(run_learning(s, on_report=show))
    tail = reports[-max(1, len(reports) // 5) :]
    last = statistics.fmean(r.mean_reward for r in tail)
    oracle = statistics.fmean(r.oracle_reward for r in tail)
    print(
        f"last 20%: reward {last:.3f} = {last / oracle:.0%} of the oracle's; {time.perf_counter() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()
