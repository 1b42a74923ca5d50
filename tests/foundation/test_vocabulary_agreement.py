"""Rollout, trajectory and trainer refuse to start (their config does not load) when the run's
tokenizer has more ids than the model's vocabulary, with an error naming both sizes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from gyre.tokenizers import load_tokenizer
from services.rollout.config import RolloutConfig
from services.trainer.config import TrainerConfig
from services.trajectory.config import TrajectoryConfig
from tests.helpers.tiny_hf import tiny_qwen2_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt() -> str:
    return str(tiny_qwen2_dir())


def test_each_service_config_refuses_a_model_smaller_than_the_tokenizer(ckpt: str) -> None:
    n = load_tokenizer(ckpt).vocab_size
    cases = [
        (
            RolloutConfig,
            {"tokenizer": ckpt, "num_tasks": 0, "model": {"vocab_size": 512}},
            "rollout.model.vocab_size",
        ),
        (TrainerConfig, {"tokenizer": ckpt, "model": {"vocab_size": 512}}, "trainer.model.vocab_size"),
        (TrajectoryConfig, {"tokenizer": ckpt, "vocab_size": 512}, "trajectory.vocab_size"),
    ]
    for cls, data, where in cases:
        with pytest.raises(ValidationError, match=rf"has {n} ids but {where} is 512"):
            cls.model_validate(data)
        fits = {**data, **({"vocab_size": 1088} if "vocab_size" in data else {"model": {"vocab_size": 1088}})}
        assert cls.model_validate(fits).tokenizer == ckpt


def test_the_byte_tokenizer_needs_its_512_rows() -> None:
    with pytest.raises(ValidationError, match="has 512 ids but rollout.model.vocab_size is 300"):
        RolloutConfig.model_validate({"model": {"vocab_size": 300}})


def test_the_workload_environment_is_refused_with_a_non_byte_tokenizer(ckpt: str) -> None:
    with pytest.raises(ValidationError, match="byte-template tokens"):
        RolloutConfig.model_validate(
            {"tokenizer": ckpt, "model": {"vocab_size": 1088}, "environment": "workload"}
        )


def test_the_trajectory_process_does_not_start_on_a_mismatch(ckpt: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    env.update(GYRE_TRAJECTORY__TOKENIZER=ckpt, GYRE_TRAJECTORY__VOCAB_SIZE="512", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "services.trajectory"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert (
        f"has {load_tokenizer(ckpt).vocab_size} ids but trajectory.vocab_size is 512"
        in proc.stdout + proc.stderr
    )
