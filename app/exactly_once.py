"""Exactly-once training, bit for bit: a trainer SIGKILLed at a random point and restarted ends with
the same weights as an uninterrupted trainer fed the same sequence of batches (CPU).

    reference = trainer process A: steps 1..N, never interrupted         -> A/final.safetensors
    restarted = trainer process B: killed (SIGKILL) after a random step k < N - 1, then
                process B': restore checkpoint + journal, finish steps k+1..N -> B/final.safetensors
    trainer_bitwise_equal = every tensor of the two files is equal (torch.equal), same sha256

Each trainer is the real `services.trainer.loop.Trainer` (Megatron GPT, AdamW, tree loss,
checkpoints and journal on disk) in its own process, one CPU thread. The one stand-in is the batch
source, the outermost edge: `FileBatchSource` serves N deterministic tree-packed batches (seeded by
index) and keeps its state in a file, as the trajectory service keeps it in Postgres — a batch is
handed out again only by id (the trainer's journal replay) or until it is acked, never twice to
one process. `gyre chaos` runs this probe and prints `trainer_bitwise_equal`; tests/ops run it too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gyre.embedded.guardian import guardian

FINAL_NAME = "final.safetensors"
STEP_LINE = "PROBE_STEP"


class FileBatchSource:
    """N deterministic batches; which were acked survives the process in `<root>/source.json`."""

    def __init__(self, root: Path, num_batches: int, seed: int) -> None:
        self.root, self.num_batches, self.seed = root, num_batches, seed
        self.path = root / "source.json"
        self.handed: set[str] = set()  # handed out to this process (the trajectory's lease)

    def _acked(self) -> list[str]:
        return list(json.loads(self.path.read_text())["acked"]) if self.path.is_file() else []

    def batch(self, batch_id: str) -> Any:
        from services.trainer.bench import branching_batch

        index = int(batch_id.removeprefix("b"))
        rng = random.Random(self.seed * 1000 + index)
        batch = branching_batch(
            prefix_len=rng.randint(4, 12),
            num_branches=rng.randint(2, 4),
            branch_len=rng.randint(2, 6),
            depth=2,
            seed=self.seed * 1000 + index,
        )
        batch.batch_id = batch_id
        return batch

    async def pull(self, current_version: int, resume_batch_id: str = "") -> Any:
        if resume_batch_id:
            self.handed.add(resume_batch_id)
            return self.batch(resume_batch_id)
        acked = set(self._acked())
        for i in range(self.num_batches):
            batch_id = f"b{i}"
            if batch_id not in acked and batch_id not in self.handed:
                self.handed.add(batch_id)
                return self.batch(batch_id)
        await asyncio.sleep(0.05)
        return None

    async def ack(self, batch_id: str, version: int) -> None:
        acked = self._acked()
        if batch_id not in acked:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"acked": [*acked, batch_id]}))
            os.replace(tmp, self.path)


async def _train(run_dir: Path, trainer_section: dict[str, Any], steps: int, seed: int) -> None:
    """One trainer process: train (resuming from run_dir if it holds a checkpoint) up to `steps`."""
    import torch

    from gyre.model import save_weights
    from services.trainer.config import TrainerConfig
    from services.trainer.loop import Trainer

    torch.set_num_threads(1)
    cfg = TrainerConfig.model_validate(
        {
            **trainer_section,
            "checkpoint_every": 2,
            "device": "cpu",
            "scheduler_address": None,
            "max_steps": 0,
            "init_weights": None,
        }
    )

    async def publish(weights: Any, metrics: dict[str, float]) -> None:
        print(f"{STEP_LINE} {int(metrics.get('step', 0))}", flush=True)

    source = FileBatchSource(run_dir, steps, seed)
    trainer = Trainer(cfg, run_dir, source, publish, seed=seed)
    await trainer.run(max_steps=steps)
    save_weights(trainer.model, run_dir / FINAL_NAME)
    trainer.close()


def _spawn(run_dir: Path, config: Path, steps: int, seed: int) -> subprocess.Popen[str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    # The guardian's token: a `gyre chaos` killed during the probe takes its trainer along.
    return subprocess.Popen(
        [sys.executable, "-m", "app.exactly_once", "--train", str(run_dir), "--config", str(config)]
        + ["--steps", str(steps), "--seed", str(seed)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=guardian().env({**os.environ, "OMP_NUM_THREADS": "1"}),
    )


def _finish(proc: subprocess.Popen[str], what: str, timeout_s: float) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} trainer exited with status {proc.returncode}:\n{out[-3000:]}")
    return out


def run_probe(
    work_dir: Path, config: Path, *, steps: int = 8, seed: int = 0, timeout_s: float = 600.0
) -> dict[str, Any]:
    """Run the probe (module docstring) under `work_dir`; returns its numbers."""
    import torch
    from safetensors.torch import load_file

    if steps < 3:
        raise ValueError(f"steps must be >= 3 (a kill needs a step before and after it), got {steps}")
    kill_after = random.Random(seed).randint(1, steps - 2)
    shutil.rmtree(work_dir, ignore_errors=True)
    reference = _spawn(work_dir / "reference", config, steps, seed)
    victim = _spawn(work_dir / "restarted", config, steps, seed)
    assert victim.stdout is not None
    killed_at = None
    for line in victim.stdout:
        if line.startswith(STEP_LINE) and int(line.split()[1]) >= kill_after:
            # Let it run into the next step for a random moment: the kill lands mid-step or later.
            time.sleep(random.Random(seed + 1).uniform(0.0, 0.5))
            victim.send_signal(signal.SIGKILL)
            killed_at = int(line.split()[1])
            break
    victim.wait()
    resumed = _spawn(work_dir / "restarted", config, steps, seed)
    _finish(resumed, "restarted", timeout_s)
    _finish(reference, "reference", timeout_s)
    a = load_file(str(work_dir / "reference" / FINAL_NAME))
    b = load_file(str(work_dir / "restarted" / FINAL_NAME))
    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return {
        "trainer_bitwise_equal": bool(equal),
        "trainer_probe_steps": steps,
        "trainer_killed_after_step": killed_at,
        "trainer_killed_exit": victim.returncode,
        "trainer_num_tensors": len(a),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.exactly_once", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="run YAML whose trainer: section is used")
    parser.add_argument("--steps", type=int, default=8, help="trainer steps (batches) of each trainer")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batches, the model and the kill")
    parser.add_argument(
        "--work-dir", type=Path, default=Path("runs/exactly_once"), help="where the trainers write"
    )
    parser.add_argument("--train", type=Path, help=argparse.SUPPRESS)  # one trainer process (internal)
    args = parser.parse_args(argv)
    from gyre.config import load_yaml

    if args.train is not None:
        section = load_yaml(args.config).get("trainer") or {}
        asyncio.run(_train(args.train, dict(section), args.steps, args.seed))
        return 0
    print(json.dumps(run_probe(args.work_dir, args.config, steps=args.steps, seed=args.seed), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
