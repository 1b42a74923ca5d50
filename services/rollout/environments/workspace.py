"""`workspace`: an NL2Repo-style coding environment in a sandboxed temp directory.

A task is a natural-language spec, optional starting files and hidden pytest tests. The agent
acts through tool calls (the tokenizer's `<tool_call>` JSON, or OpenAI `tool_calls`):

- `write_file(path, content)`, `read_file(path)`, `list_files()` — jailed to the workspace;
- `run(command)` — a shell command under the sandbox's limits (see sandbox.py);
- `submit()` — ends the episode (`done`; reward = fraction of hidden tests passing).

Scoring (`score`): the hidden tests exist only in memory until the moment of scoring. Then a fresh
directory the agent never saw gets a copy of the workspace's own regular files (`code/`, no
symlinks) and the tests (`tests/`, with Gyre's own `pytest.ini`), and the scorer runs as another
sandbox user (a uid of its own when the service is root, so it cannot write the workspace) with an
isolated interpreter: `python -I -B`, pytest imported from the environment's own install before
`code/` is APPENDED to `sys.path` - a `pytest.py`, `conftest.py` or ini file in the workspace
shadows nothing and is never loaded. Every scorer process is killed and the directory removed
after. The code under test still runs inside the scorer's pytest process, so code written to
tamper with pytest at import time is not prevented (docs/rollout.md).

After any action that may change files the tests are re-run (skipped if the workspace content is
unchanged), so `progress.tests_passed_fraction` is the fraction passing *now*, at any time.
Running out of turns truncates the episode with that partial score.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.errors import InvalidArgument
from gyre.tokenizer import ToolCall

from .base import Action, Environment, Progress, StepResult, TaskFamily
from .sandbox import SandboxLimits, SandboxUser, Workspace, sandbox_path

_TEST_DEF = re.compile(r"^\s*(?:async\s+)?def\s+test_\w*\s*\(", re.MULTILINE)

# The scorer's program (run with `python -I -B`): pytest from this interpreter's own install, the
# agent's code appended to the import path (after stdlib and site-packages), only Gyre's ini file.
_SCORER = """
import sys
code, tests, report = sys.argv[1:4]
import pytest
sys.path.append(code)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--import-mode=append", "--rootdir", tests,
                      "--confcutdir", tests, "--junitxml", report, tests]))
"""
_MAX_REPORT_BYTES = 16 << 20

log = logging.getLogger(__name__)

TOOLS_SCHEMA: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "write_file", "description": "Write a text file in the workspace.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a text file of the workspace.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "list_files", "description": "List the workspace's files.",
     "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "run", "description": "Run a shell command in the workspace.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "submit", "description": "Finish the task.",
     "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip


@dataclass(frozen=True)
class WorkspaceTask:
    """One coding task as stored in JSONL."""

    task_id: str
    spec: str
    tests: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)
    max_turns: int = 30
    # Reference solution (path -> text), never shown to the agent; used by scripted-agent tests.
    solution: dict[str, str] = field(default_factory=dict)

    @property
    def num_tests(self) -> int:
        return sum(len(_TEST_DEF.findall(src)) for src in self.tests.values())


def load_tasks(path: str | Path) -> list[WorkspaceTask]:
    """Tasks from a JSONL file (one JSON object per line); a bad line is an error naming the line."""
    tasks = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            task = WorkspaceTask(
                task_id=str(obj["task_id"]),
                spec=str(obj["spec"]),
                tests={str(k): str(v) for k, v in obj["tests"].items()},
                files={str(k): str(v) for k, v in (obj.get("files") or {}).items()},
                max_turns=int(obj.get("max_turns", 30)),
                solution={str(k): str(v) for k, v in (obj.get("solution") or {}).items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidArgument(
                f"{path}:{n}: not a workspace task ({exc!r}); need task_id, spec, tests"
            ) from exc
        if not re.fullmatch(r"[A-Za-z0-9_-]+", task.task_id) or task.num_tests == 0:
            raise InvalidArgument(
                f"{path}:{n}: task_id must be [A-Za-z0-9_-]+ and tests must define test_ functions"
            )
        tasks.append(task)
    return tasks


def _read_only_for_others(base: Path) -> None:
    """Scoring tree: root-owned, readable (not writable) by the scorer; `base` itself not listable."""
    for dirpath, _, filenames in os.walk(base):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)
    os.chmod(base, 0o711)


def _passed_tests(report: Path) -> int:
    """Test cases without failure, error or skip in a junit XML written by the scorer (0 if none)."""
    try:
        st = os.lstat(report)
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_REPORT_BYTES:
        return 0
    try:
        root = ET.parse(report).getroot()
    except ET.ParseError:
        return 0
    return sum(
        1
        for case in root.iter("testcase")
        if not any(child.tag in {"failure", "error", "skipped"} for child in case)
    )


class WorkspaceEnv(Environment):
    name = "workspace"
    # Resumes by replaying the tool calls into a fresh workspace: exact for file tools; a `run` whose
    # output differs the second time fails the resume's prompt check and ends the execution instead.
    resumable = True

    def __init__(self, task: WorkspaceTask, limits: SandboxLimits | None = None) -> None:
        self.task, self.task_id = task, task.task_id
        self.limits = limits or SandboxLimits()
        self.ws: Workspace | None = None
        self.turns = 0
        self._fraction = 0.0
        self._scored_digest = ""

    async def reset(self) -> list[dict[str, Any]]:
        await self.close()
        self.ws = Workspace(self.limits)
        for rel, text in self.task.files.items():
            self.ws.write_file(rel, text)
        self.turns, self._fraction, self._scored_digest = 0, 0.0, ""
        await self.score()
        tools = ", ".join(t["function"]["name"] for t in TOOLS_SCHEMA)
        return [
            {"role": "system", "content": f"You edit files in a workspace with tools: {tools}."},
            {"role": "user", "content": self.task.spec},
        ]

    @property
    def progress(self) -> Progress:
        return Progress(tests_passed_fraction=self._fraction, extra={"turns": float(self.turns)})

    def _digest(self) -> str:
        assert self.ws is not None
        h = hashlib.sha256()
        for rel in self.ws.list_files():
            h.update(rel.encode() + b"\0")
            try:
                h.update(self.ws.read_file(rel, max_bytes=1 << 24).encode())
            except InvalidArgument:
                pass
        return h.hexdigest()

    async def score(self) -> float:
        """Run the hidden tests against the workspace; the fraction passing (cached by content)."""
        if self.ws is None:
            raise InvalidArgument("workspace environment used before reset()")
        digest = self._digest()
        if digest == self._scored_digest:
            return self._fraction
        scorer = SandboxUser(interpreter=sys.executable)
        base = Path(tempfile.mkdtemp(prefix="gyre-score-"))
        try:
            code, tests, out = base / "code", base / "tests", base / "out"
            for d in (code, tests, out):
                d.mkdir()
            self.ws.copy_files_to(code)
            for rel, text in self.task.tests.items():
                (tests / Path(rel).name).write_text(text)
            (tests / "pytest.ini").write_text("[pytest]\n")
            _read_only_for_others(base)
            scorer.chown(out)
            report = out / "report.xml"
            await scorer.run(
                [sys.executable, "-I", "-B", "-c", _SCORER, str(code), str(tests), str(report)],
                cwd=out,
                env={"PATH": sandbox_path(), "HOME": str(out), "TMPDIR": str(out),
                     "LANG": "C.UTF-8", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
                limits=self.limits,
                timeout_s=self.limits.timeout_s * 3,
            )  # fmt: skip
            passed = _passed_tests(report)
        finally:
            scorer.close()
            shutil.rmtree(base, ignore_errors=True)
        self._fraction = min(1.0, passed / self.task.num_tests)
        self._scored_digest = digest
        return self._fraction

    async def _call(self, call: ToolCall) -> tuple[str, bool]:
        """Run one tool call; returns (observation text, submitted?). Bad calls become observations."""
        assert self.ws is not None
        try:
            args = json.loads(call.arguments) if call.arguments.strip() else {}
            if not isinstance(args, dict):
                raise InvalidArgument("tool arguments must be a JSON object")
            if call.name == "write_file":
                n = self.ws.write_file(str(args["path"]), str(args["content"]))
                return f"wrote {n} bytes to {args['path']}", False
            if call.name == "read_file":
                return self.ws.read_file(str(args["path"])), False
            if call.name == "list_files":
                return "\n".join(self.ws.list_files()) or "(empty)", False
            if call.name == "run":
                res = await self.ws.run_shell(str(args["command"]))
                status = "timed out" if res.timed_out else f"exit {res.returncode}"
                return f"[{status}]\n{res.output}", False
            if call.name == "submit":
                return "submitted", True
            return f"error: unknown tool {call.name!r}", False
        except (InvalidArgument, KeyError, ValueError, OSError) as exc:
            return f"error: {exc}", False

    async def step(self, action: Action) -> StepResult:
        if self.ws is None:
            raise InvalidArgument("workspace environment used before reset()")
        self.turns += 1
        messages: list[dict[str, Any]] = []
        submitted = False
        for call in action.turn.tool_calls:
            text, submitted = await self._call(call)
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text})
            if submitted:
                break
        if not action.turn.tool_calls:
            messages.append({"role": "user", "content": "Use a tool (write_file, run, submit...)."})
        await self.score()
        if submitted:
            return StepResult(messages, self.progress, done=True, reward=self._fraction)
        if self.turns >= self.task.max_turns:
            return StepResult(messages, self.progress, truncated=True)
        return StepResult(messages, self.progress)

    async def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
            self.ws = None


class WorkspaceFamily(TaskFamily):
    name = "workspace"

    def __init__(self, tasks: list[WorkspaceTask], limits: SandboxLimits | None = None) -> None:
        if not tasks:
            raise InvalidArgument("workspace: no tasks loaded")
        self.tasks = {t.task_id: t for t in tasks}
        self.limits = limits

    @classmethod
    def from_jsonl(cls, path: str | Path, limits: SandboxLimits | None = None) -> WorkspaceFamily:
        """Tasks from JSONL. The file holds the hidden tests: a sandboxed command can read it if it is
        readable by others (it runs as an unprivileged user), so that is logged as a warning."""
        if os.stat(path).st_mode & stat.S_IROTH:
            log.warning(
                "workspace tasks %s are readable by other users: sandboxed commands can read the hidden "
                "tests in it; chmod 600 it (or keep it in a 0700 directory) for training",
                path,
            )
        return cls(load_tasks(path), limits)

    def task_ids(self, num_tasks: int) -> list[str]:
        return list(self.tasks)[:num_tasks]

    def make(self, task_id: str) -> WorkspaceEnv:
        if task_id not in self.tasks:
            raise InvalidArgument(f"unknown workspace task {task_id!r}; known: {sorted(self.tasks)}")
        return WorkspaceEnv(self.tasks[task_id], self.limits)
