"""`workspace`: an NL2Repo-style coding environment in a sandboxed temp directory.

A task is a natural-language spec, optional starting files and hidden pytest tests. The agent
acts through tool calls (the tokenizer's `<tool_call>` JSON, or OpenAI `tool_calls`):

- `write_file(path, content)`, `read_file(path)`, `list_files()` — jailed to the workspace;
- `run(command)` — a shell command under the sandbox's limits (see sandbox.py);
- `submit()` — ends the episode (`done`; reward = fraction of hidden tests passing).

The hidden tests live in a separate temp directory that the file tools cannot reach. After any
action that may change files the tests are re-run (skipped if the workspace content is unchanged),
so `progress.tests_passed_fraction` is the fraction passing *now*, at any time. Running out of
turns truncates the episode with that partial score.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.errors import InvalidArgument
from gyre.tokenizer import ToolCall

from .base import Action, Environment, Progress, StepResult, TaskFamily
from .sandbox import SandboxLimits, Workspace

_TEST_DEF = re.compile(r"^\s*(?:async\s+)?def\s+test_\w*\s*\(", re.MULTILINE)

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


class WorkspaceEnv(Environment):
    name = "workspace"

    def __init__(self, task: WorkspaceTask, limits: SandboxLimits | None = None) -> None:
        self.task, self.task_id = task, task.task_id
        self.limits = limits or SandboxLimits()
        self.ws: Workspace | None = None
        self.hidden: Path | None = None
        self.turns = 0
        self._fraction = 0.0
        self._scored_digest = ""

    async def reset(self) -> list[dict[str, Any]]:
        await self.close()
        self.ws = Workspace(self.limits)
        self.hidden = Path(tempfile.mkdtemp(prefix="gyre-hidden-"))
        for rel, text in self.task.files.items():
            self.ws.write_file(rel, text)
        for rel, text in self.task.tests.items():
            (self.hidden / Path(rel).name).write_text(text)
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
        if self.ws is None or self.hidden is None:
            raise InvalidArgument("workspace environment used before reset()")
        digest = self._digest()
        if digest == self._scored_digest:
            return self._fraction
        report = self.hidden / "report.xml"
        report.unlink(missing_ok=True)
        await self.ws.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
             f"--rootdir={self.hidden}", str(self.hidden)],
            timeout_s=self.limits.timeout_s * 3,
            extra_env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},  # the scorer needs no plugins; starts faster
        )  # fmt: skip
        passed = 0
        if report.exists():
            root = ET.parse(report).getroot()
            for case in root.iter("testcase"):
                if not any(child.tag in {"failure", "error", "skipped"} for child in case):
                    passed += 1
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
        if self.hidden is not None:
            shutil.rmtree(self.hidden, ignore_errors=True)
            self.hidden = None


class WorkspaceFamily(TaskFamily):
    name = "workspace"

    def __init__(self, tasks: list[WorkspaceTask], limits: SandboxLimits | None = None) -> None:
        if not tasks:
            raise InvalidArgument("workspace: no tasks loaded")
        self.tasks = {t.task_id: t for t in tasks}
        self.limits = limits

    @classmethod
    def from_jsonl(cls, path: str | Path, limits: SandboxLimits | None = None) -> WorkspaceFamily:
        return cls(load_tasks(path), limits)

    def task_ids(self, num_tasks: int) -> list[str]:
        return list(self.tasks)[:num_tasks]

    def make(self, task_id: str) -> WorkspaceEnv:
        if task_id not in self.tasks:
            raise InvalidArgument(f"unknown workspace task {task_id!r}; known: {sorted(self.tasks)}")
        return WorkspaceEnv(self.tasks[task_id], self.limits)
