"""The reward of the example agent: partial credit by milestones (Gyre calls it after the agent exits).

Gyre calls `score(task, workdir, output, exit_code)`: `task` is the task's JSONL object, `workdir`
the agent's working directory, `output` its stdout and `exit_code` its status (None: timed out).
Milestones: the answer holds a digit; it holds a digit of the right answer; it holds the right answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def score(task: dict[str, Any], workdir: str, output: str, exit_code: int | None) -> dict[str, Any]:
    expected = str(task["answer"])
    path = Path(workdir) / "answer.txt"
    answer = path.read_text(errors="replace") if path.is_file() else ""
    reached = sum(
        (
            any(ch.isdigit() for ch in answer),
            any(ch in answer for ch in expected),
            expected in answer,
        )
    )
    return {"milestones_reached": reached, "milestones_total": 3}
