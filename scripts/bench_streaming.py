"""Streaming vs whole-batch steps of the trainer, against the real trajectory service.

Usage: python scripts/bench_streaming.py [--steps 4] [--groups-per-step 3] [--interval-s 1.0] [--repeats 2] [--turns 6]

Embedded NATS and Postgres, the real TrajectoryService, the real Trainer (the default tiny model,
float32, CPU, one rank). A publisher sends one group of executions every `--interval-s` seconds
(the cadence at which groups finish and are scored). The step's budget is exactly
`--groups-per-step` groups (every group has the same shape and tree tokens, measured first
with a calibration group), so both modes train the same groups per step:
- whole: trajectory `min_batch_fill` 1.0 — a batch is built once the step's groups are all scored,
  then pulled and trained;
- streaming: `trainer.streaming` — each group is pulled and trained as a part as soon as it is
  scored; the step ends when the budget is full.

Printed (one JSON object on stdout): per mode the median over repeats of `s_per_step` (first
group published to last weights published, divided by the steps) and `tail_s` (mean seconds from
the publication of a step's last group to the step's weights: what the step adds after its data is
there), with `streaming_tail_speedup` = whole tail / streaming tail and `streaming_step_speedup`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKLOAD = dict(
    group_size=3,
    task_prompt_tokens=64,
    num_turns=6,
    generated_tokens=32,
    observation_tokens=32,
    compaction_every=100,  # no compaction, no retries, no duplicates: every group has the same tokens
    summary_tokens=8,
    retry_fraction=0.0,
    shared_early_turns=1,
    exact_duplicates_per_group=0,
    near_duplicates_per_group=0,
)


async def _publish(bus: Any, run_id: str, execs: list[Any]) -> None:
    from gyre.bus import subjects
    from services.trajectory.synthetic import end_event, step_event

    for ex in execs:
        for c in ex.calls:
            await bus.publish(
                subjects.steps(run_id, c.task_id),
                step_event(run_id, c),
                msg_id=f"{c.execution_id}.{c.call_seq}",
            )
    for i, ex in enumerate(execs):
        ev = end_event(run_id, ex, 0.2 + 0.3 * i)
        await bus.publish(subjects.executions(run_id, ex.task_id), ev, msg_id=ev.event_id)


def _groups(num: int, seed: int, turns: int) -> list[list[Any]]:
    """`num` groups of one shape: copies of one generated group under new ids, every token id shifted
    by the group's index (mod the vocabulary), so every group has the same tree tokens."""
    import dataclasses

    from services.trajectory.synthetic import WorkloadConfig, generate

    cfg = WorkloadConfig(num_groups=1, seed=seed, **{**WORKLOAD, "num_turns": turns})  # type: ignore[arg-type]
    template = generate(cfg)
    out = []
    for i in range(num):
        task, group = f"t{i:04d}", f"t{i:04d}-g0"

        def shift(a: Any, i: int = i) -> Any:
            return (a + i) % cfg.vocab

        out.append(
            [
                dataclasses.replace(
                    ex,
                    task_id=task,
                    group_id=group,
                    execution_id=f"{group}-e{j}",
                    calls=[
                        dataclasses.replace(
                            c,
                            task_id=task,
                            group_id=group,
                            execution_id=f"{group}-e{j}",
                            prompt=shift(c.prompt),
                            completion=shift(c.completion),
                        )
                        for c in ex.calls
                    ],
                )
                for j, ex in enumerate(template)
            ]
        )
    return out


async def _one(
    urls: tuple[str, str],
    run_dir: Path,
    run_id: str,
    streaming: bool,
    args: argparse.Namespace,
    group_tokens: int,
) -> dict[str, float]:
    from gyre import rpc
    from gyre.bus import Bus
    from gyre.config import CommonConfig
    from gyre.service import Runtime
    from services.trainer.config import TrainerConfig
    from services.trainer.data import TrajectoryBatchSource
    from services.trainer.loop import Trainer
    from services.trainer.service import publish_weights_event
    from services.trajectory.config import TrajectoryConfig
    from services.trajectory.service import TrajectoryService

    nats_url, db_url = urls
    from gyre import store

    engine = store.create_engine(db_url)
    bus = await Bus.connect(nats_url, name="bench-streaming")
    await bus.ensure_streams()
    server, port = rpc.create_server()
    common = CommonConfig.model_validate({"run_id": run_id, "nats_url": nats_url, "database_url": db_url})
    budget = group_tokens * args.groups_per_step
    tcfg = {
        "ready_poll_s": 0.05,
        "max_batch_tokens": budget,
        "min_batch_fill": 1.0,
        "batch_max_wait_s": 3600.0,
    }
    service = TrajectoryService(common, TrajectoryConfig.model_validate(tcfg))
    await service.start(
        Runtime(common=common, bus=bus, engine=engine, server=server, port=port, name="trajectory")
    )
    await server.start()
    cfg = TrainerConfig(
        device="cpu",
        batch_max_tokens=budget,
        pull_wait_s=30.0,
        checkpoint_every=1000,
        streaming=streaming,
        stream_wait_s=5 * args.interval_s,
        trajectory_address=f"127.0.0.1:{port}",
    )
    source = TrajectoryBatchSource(cfg.trajectory_address, run_id, "trainer-0", budget, cfg.pull_wait_s)
    done: list[float] = []

    async def sink(weights: Any, metrics: dict[str, float]) -> None:
        await publish_weights_event(bus, run_id, weights, metrics)  # the trajectory's staleness clock
        done.append(time.perf_counter())

    trainer = await asyncio.to_thread(Trainer, cfg, run_dir, source, sink, 0)
    groups = _groups(args.steps * args.groups_per_step, seed=3, turns=args.turns)
    published: list[float] = []

    async def publisher() -> None:
        for g in groups:
            published.append(time.perf_counter())
            await _publish(bus, run_id, g)
            await asyncio.sleep(args.interval_s)

    pub = asyncio.create_task(publisher())
    await trainer.run(max_steps=args.steps)
    await pub
    await source.close()
    await service.stop()
    await server.stop(0)
    await bus.close()
    engine.dispose()
    trainer.close()
    k = args.groups_per_step
    tails = [done[n] - published[(n + 1) * k - 1] for n in range(args.steps)]
    return {"s_per_step": (done[-1] - published[0]) / args.steps, "tail_s": statistics.mean(tails)}


async def _calibrate(urls: tuple[str, str], run_id: str, turns: int) -> int:
    """Tree tokens of one group of this workload, as the real service packs it (a streamed part)."""
    from gyre import rpc, store
    from gyre.bus import Bus
    from gyre.config import CommonConfig
    from gyre.service import Runtime
    from services.trainer.data import TrajectoryBatchSource
    from services.trajectory.config import TrajectoryConfig
    from services.trajectory.service import TrajectoryService

    engine = store.create_engine(urls[1])
    bus = await Bus.connect(urls[0], name="bench-streaming")
    await bus.ensure_streams()
    server, port = rpc.create_server()
    common = CommonConfig.model_validate({"run_id": run_id, "nats_url": urls[0], "database_url": urls[1]})
    service = TrajectoryService(common, TrajectoryConfig.model_validate({"ready_poll_s": 0.05}))
    await service.start(
        Runtime(common=common, bus=bus, engine=engine, server=server, port=port, name="trajectory")
    )
    await server.start()
    tokens = []
    source = TrajectoryBatchSource(f"127.0.0.1:{port}", run_id, "trainer-0", 1 << 20, 30.0)
    for g in _groups(2, seed=3, turns=turns):
        await _publish(bus, run_id, g)
        part = await source.pull_part(0, 1 << 20, 0, 30.0)
        assert part is not None
        tokens.append(part.num_tokens)
    await source.close()
    await service.stop()
    await server.stop(0)
    await bus.close()
    engine.dispose()
    if len(set(tokens)) != 1:
        raise SystemExit(
            f"groups of this workload differ in tree tokens ({tokens}): the budget would not hold equal steps"
        )
    return tokens[0]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from gyre import store
    from gyre.embedded import EmbeddedNats, EmbeddedPostgres

    out: dict[str, Any] = {
        "turns": args.turns,
        "steps": args.steps,
        "groups_per_step": args.groups_per_step,
        "interval_s": args.interval_s,
    }
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedNats(Path(tmp) / "nats") as nats,
        EmbeddedPostgres(Path(tmp) / "pg", durable=False) as pg,
    ):
        assert nats.url is not None and pg.url is not None
        urls = (nats.url, pg.url)
        migrations = ROOT / "services" / "trajectory" / "migrations"
        await asyncio.to_thread(store.upgrade, pg.url, migrations, "alembic_version_trajectory")
        group_tokens = await _calibrate(urls, "calibrate", args.turns)
        out["group_tokens"] = group_tokens
        results: dict[str, list[dict[str, float]]] = {"whole": [], "streaming": []}
        for r in range(args.repeats):
            for mode in ("whole", "streaming"):  # interleaved: machine load drifts over both alike
                run_dir = Path(tmp) / f"{mode}{r}"
                res = await _one(urls, run_dir, f"{mode}{r}", mode == "streaming", args, group_tokens)
                print(f"{mode} #{r}: {res}", file=sys.stderr)
                results[mode].append(res)
    for mode, rs in results.items():
        out[mode] = {key: statistics.median(x[key] for x in rs) for key in ("s_per_step", "tail_s")}
    out["streaming_tail_speedup"] = out["whole"]["tail_s"] / out["streaming"]["tail_s"]
    out["streaming_step_speedup"] = out["whole"]["s_per_step"] / out["streaming"]["s_per_step"]
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--groups-per-step", type=int, default=3)
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between two groups published")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--turns", type=int, default=6, help="agent turns per execution (tokens per group)")
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(args)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
