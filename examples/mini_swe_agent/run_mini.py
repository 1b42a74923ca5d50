"""Launch mini-swe-agent, unmodified, on the task Gyre hands this process (the harness command).

This is configuration in a file, not an agent: it reads the task Gyre writes to stdin, sets the
environment variables mini-swe-agent and litellm document, and runs mini-swe-agent's own `mini`
command (its console-script entry point `minisweagent.run.mini:app`, called in this process) as

    mini -c examples/mini_swe_agent/mini.yaml --model openai/$OPENAI_MODEL --task <the task's spec>
         --output <its trajectory file, in $TMPDIR>

In this process rather than through the `mini` script on PATH: the script's `#!` line names the
virtual environment's interpreter, which a sandbox user may not be able to execute a second time
(a venv whose base interpreter lies under a 0700 home); the agent's own interpreter is running.

- The model: litellm's `openai/` route reads OPENAI_BASE_URL and OPENAI_API_KEY, which Gyre sets to
  this execution's own endpoint and key, so every call mini-swe-agent makes lands in this execution.
- `MSWEA_CONFIGURED` skips mini's first-run setup prompt; `MSWEA_SILENT_STARTUP` its banner;
  `MSWEA_GLOBAL_CONFIG_DIR` keeps its global config under this execution's TMPDIR;
  `LITELLM_LOCAL_MODEL_COST_MAP` makes litellm use its bundled price table instead of fetching one.
- The task: the workspace spec (`task.spec`), else the last user message of the opening messages.
  mini-swe-agent's LocalEnvironment runs its bash commands in this process's working directory,
  which is the task's workspace, so the hidden tests score what it changed there.

Run it by hand against any OpenAI-compatible server:

    echo '{"task": {"spec": "Create hello.txt"}}' | OPENAI_BASE_URL=http://127.0.0.1:8000/v1 \
        OPENAI_API_KEY=... python examples/mini_swe_agent/run_mini.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

MINI_CONFIG = Path(__file__).resolve().parent / "mini.yaml"


def task_text(payload: dict[str, Any]) -> str:
    """The problem statement: the workspace task's spec, else the last user message."""
    spec = (payload.get("task") or {}).get("spec")
    if spec:
        return str(spec)
    users = [m.get("content") for m in payload.get("messages", []) if m.get("role") == "user"]
    if not users or not isinstance(users[-1], str):
        raise SystemExit("run_mini.py: the task has neither task.spec nor a user message")
    return users[-1]


def main() -> int:
    payload = json.loads(sys.stdin.read() or "{}")
    tmp = Path(os.environ.get("TMPDIR") or ".")
    os.environ.update(
        MSWEA_CONFIGURED="true",
        MSWEA_SILENT_STARTUP="1",
        MSWEA_GLOBAL_CONFIG_DIR=str(tmp / "mini-swe-agent"),
        LITELLM_LOCAL_MODEL_COST_MAP="True",
    )
    args = [
        "-c",
        str(MINI_CONFIG),
        "--model",
        f"openai/{os.environ.get('OPENAI_MODEL', 'gyre')}",
        "--task",
        task_text(payload),
        "--output",
        str(tmp / "mini.traj.json"),
    ]
    from minisweagent.run.mini import app  # after the environment above: it is read at import

    try:
        app(args, prog_name="mini")  # exits (SystemExit) with mini's status, like the `mini` script
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
