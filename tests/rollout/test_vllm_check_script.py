"""`scripts/gpu_check.sh --vllm` runs end to end against the test fake of `vllm serve`.

The fake (tests/helpers/fake_vllm.py, the outermost edge: no vLLM here) stands in for the real
server so that the script a GPU host runs is itself tested; its numbers say nothing about vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_vllm_section_of_the_gpu_check_starts_generates_reloads_sleeps_and_migrates() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FAKE_VLLM_TOKEN_DELAY_S": "0.02", "PYTHON": sys.executable}
    cmd = [
        "bash", "scripts/gpu_check.sh", "--vllm", "--allow-cpu",
        "--command", f"{sys.executable} -m tests.helpers.fake_vllm serve",
        "--max-tokens", "8", "--migrate-tokens", "40", "--drain-after", "6", "--start-timeout-s", "120",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["start"]["servers"] == 2
    assert result["generate"]["tokens"] == 8 and result["generate"]["equal_fraction"] == 1.0
    assert result["reload"]["version"] == 1 and result["reload"]["equal_fraction"] == 1.0
    assert result["sleep_wake"]["same_tokens_after_wake"] and result["sleep_wake"]["version_after_wake"] == 1
    assert result["migrate"]["migrations"] == 1 and result["migrate"]["engines"] == ["a1", "b0"]
    assert result["migrate"]["token_exact"] and result["migrate"]["length"] == 40
