"""Tasks of a JSONL file for an external agent (`rollout.harness.tasks`): no steps, scored afterwards.

Each line is one JSON object with a `task_id` of [A-Za-z0-9_-] and a `prompt` string or a
`messages` list; every other field is the user's and is handed to the agent as-is. The environment
has no steps (the external agent acts on its own, services/rollout/harness.py); its progress stays
empty and the execution is scored by the configured reward function.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.errors import InvalidArgument

from .base import Action, Environment, Progress, StepResult, TaskFamily


@dataclass
class JsonTask:
    """One task of a `harness.tasks` JSONL file: `task_id`, a `prompt` and any fields of the user's."""

    task_id: str
    fields: dict[str, Any] = field(default_factory=dict)


class JsonTaskEnv(Environment):
    """A task for an external agent: no steps (the agent acts on its own), scored by the reward function."""

    name = "tasks"

    def __init__(self, task: JsonTask) -> None:
        self.task, self.task_id = task, task.task_id
        self._progress = Progress()

    async def reset(self) -> list[dict[str, Any]]:
        messages = self.task.fields.get("messages")
        if isinstance(messages, list):
            return list(messages)
        return [{"role": "user", "content": str(self.task.fields.get("prompt", ""))}]

    async def step(self, action: Action) -> StepResult:
        raise InvalidArgument("a harness task has no steps: the external agent acts on its own")

    @property
    def progress(self) -> Progress:
        return self._progress


class JsonTaskFamily(TaskFamily):
    """The tasks of one JSONL file, by task_id, in file order."""

    name = "tasks"

    def __init__(self, tasks: list[JsonTask]) -> None:
        if not tasks:
            raise InvalidArgument("harness.tasks: no tasks")
        self.tasks = {t.task_id: t for t in tasks}

    @classmethod
    def from_jsonl(cls, path: str | Path) -> JsonTaskFamily:
        """Tasks from JSONL: one object per line with `task_id` ([A-Za-z0-9_-]) and `prompt` or `messages`."""
        if not Path(path).is_file():
            raise InvalidArgument(f"harness.tasks {path} does not exist (a JSONL file of tasks)")
        tasks = []
        for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise InvalidArgument(f"{path}:{n}: not JSON ({exc})") from exc
            task_id = obj.get("task_id") if isinstance(obj, dict) else None
            if not isinstance(task_id, str) or not task_id.replace("-", "").replace("_", "").isalnum():
                raise InvalidArgument(f"{path}:{n}: needs a task_id of [A-Za-z0-9_-]")
            if "prompt" not in obj and not isinstance(obj.get("messages"), list):
                raise InvalidArgument(f"{path}:{n}: needs a 'prompt' string or a 'messages' list")
            tasks.append(JsonTask(task_id, obj))
        return cls(tasks)

    def task_ids(self, num_tasks: int) -> list[str]:
        return list(self.tasks)[:num_tasks]

    def make(self, task_id: str) -> JsonTaskEnv:
        if task_id not in self.tasks:
            raise InvalidArgument(f"unknown task {task_id!r}; known: {sorted(self.tasks)}")
        return JsonTaskEnv(self.tasks[task_id])
