"""External harness mode (`rollout.harness: external`): every execution is one run of the user's agent.

    ExecutionManager.start_group -> for each execution: ExternalHarness.run(spec, env)
        ExecutionEvent STARTED; env.reset()       -> the task (opening messages, task fields)
        issue_execution_endpoint(...)             -> (OPENAI_BASE_URL, OPENAI_API_KEY) of THIS execution
        launch `harness_command` as the sandbox user (own process group, rlimits, cwd = work directory)
            stdin: the task as one JSON object; the same JSON in the file $GYRE_TASK_FILE
            every model call it makes -> the OpenAI endpoint -> router -> StepEvent (call_seq 0..n-1)
        wait for its exit, at most `harness_timeout_s` (then SIGTERM, then SIGKILL to the whole group)
        score: the reward callable (`harness_reward`) or the environment's own tests / milestones
        endpoint.end(...) -> ExecutionEvent FINISHED (exit 0) | TRUNCATED (timed out) | FAILED
            (non-zero exit) with reward and progress; later calls with that URL or key get 409/401.
            The trajectory service scores and trains it like any execution

The agent needs nothing from Gyre: the key names the execution, so an agent written against the
official `openai` client (which reads OPENAI_BASE_URL / OPENAI_API_KEY) lands in one execution of
the right group. The agent's input contract (docs/rollout.md, "External harness"):

    stdin / $GYRE_TASK_FILE: {"run_id", "task_id", "group_id", "execution_id",
                              "messages": [opening chat messages], "task": {task fields},
                              "workdir": cwd of the process}
    environment: OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL ("gyre"; any name is accepted),
                 GYRE_TASK_FILE, GYRE_EXECUTION_ID (informational), GYRE_SANDBOX (a kill marker),
                 PATH (the interpreter's directory + system), HOME/TMPDIR (in workdir)
    exit status: 0 = the agent finished; anything else = the execution FAILED (stderr tail kept)

Guarantees: one process (group) per execution, never reused. The agent runs as a sandbox user
(environments/sandbox.py's SandboxUser: a uid of its own when the service is root, through
`setpriv --no-new-privs`; else the service's user with a marker in its environment), with
rlimits and a minimal environment (no other GYRE_* variables, no proxies). When its first process
ends (exit or timeout) every process of its group and of its sandbox user is killed, so no child -
not even a `setsid` daemon - outlives the execution. The final event is published by the
endpoint as it closes the execution, so its call count is final; the per-execution URL and key
work from issue to that end (while the agent runs and is scored), never after. What it is not: a
full sandbox. The agent keeps the host's network (it must reach the endpoint over loopback) and
file system (what its uid may read); run the rollout in a container for untrusted agents.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gyre.errors import InvalidArgument
from gyre.v1 import events_pb2

from .agent import ExecutionOutcome, ExecutionSpec
from .environments.base import Action, Environment, Progress, StepResult, TaskFamily
from .environments.sandbox import SandboxUser, kill_sandbox, sandbox_path
from .steps import StepSink

log = logging.getLogger(__name__)

E = events_pb2.ExecutionEvent

RewardFn = Callable[..., Any]
"""`fn(task: dict, workdir: str, output: str, exit_code: int | None) -> float | dict` (or async).

A float is the reward. A dict may hold `reward`, `milestones_reached`, `milestones_total`,
`tests_passed_fraction`; without `reward` the reward is the partial score of those signals
(tests fraction, else milestone fraction). `output` is the agent's stdout (tail, at most
`harness_max_output_bytes`); `exit_code` is None when the agent timed out.
"""


class ExecutionEndpoints(Protocol):
    """What the harness needs from the OpenAI-compatible endpoint (services/rollout/openai/)."""

    def issue(self, spec: ExecutionSpec) -> tuple[str, str]:
        """(base_url, api_key) through which calls land in `spec`'s execution (call_seq from 0)."""
        ...

    async def end(
        self, spec: ExecutionSpec, kind: str, reward: float | None, error: str, progress: Progress
    ) -> int:
        """Publish the execution's final ExecutionEvent and refuse its later calls; its call count."""
        ...


class OpenAIExecutions:
    """`ExecutionEndpoints` of the rollout's OpenAI endpoint (per-execution URL + key)."""

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint

    def issue(self, spec: ExecutionSpec) -> tuple[str, str]:
        from .openai import issue_execution_endpoint

        return issue_execution_endpoint(
            self.endpoint, task_id=spec.task_id, group_id=spec.group_id, execution_id=spec.execution_id
        )

    async def end(
        self, spec: ExecutionSpec, kind: str, reward: float | None, error: str, progress: Progress
    ) -> int:
        from gyre.errors import NotFound

        try:
            return int(
                await self.endpoint.end(
                    spec.execution_id, kind, reward=reward, error=error[-2000:], progress=progress
                )
            )
        except NotFound:  # the agent ended it itself (POST /gyre/end) or it idled out: already published
            log.warning("execution %s was already ended through the endpoint", spec.execution_id)
            return 0


@dataclass(frozen=True)
class HarnessSettings:
    """The harness part of RolloutConfig (see its `harness_*` fields for meanings and units)."""

    command: list[str]
    timeout_s: float = 600.0
    kill_grace_s: float = 2.0
    memory_bytes: int = 4 << 30
    cpu_s: int = 3600
    max_open_files: int = 1024
    max_processes: int = 256
    max_output_bytes: int = 65536
    reward: str | None = None


# -- task sources -----------------------------------------------------------------------------


@dataclass
class JsonTask:
    """One task of a `harness_tasks` JSONL file: `task_id`, a `prompt` and any fields of the user's."""

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
    name = "tasks"

    def __init__(self, tasks: list[JsonTask]) -> None:
        if not tasks:
            raise InvalidArgument("harness_tasks: no tasks")
        self.tasks = {t.task_id: t for t in tasks}

    @classmethod
    def from_jsonl(cls, path: str | Path) -> JsonTaskFamily:
        """Tasks from JSONL: one object per line with `task_id` ([A-Za-z0-9_-]) and `prompt` or `messages`."""
        if not Path(path).is_file():
            raise InvalidArgument(f"harness_tasks {path} does not exist (a JSONL file of tasks)")
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


# -- reward -----------------------------------------------------------------------------------


def load_reward(spec: str) -> RewardFn:
    """The callable named by `module.path:function`, `module.path.function` or `path/to/file.py:function`."""
    if ":" in spec:
        where, name = spec.rsplit(":", 1)
    else:
        where, _, name = spec.rpartition(".")
    if not where or not name:
        raise InvalidArgument(f"harness_reward {spec!r}: use 'package.module:function' or 'file.py:function'")
    try:
        if where.endswith(".py"):
            file_spec = importlib.util.spec_from_file_location(f"gyre_reward_{Path(where).stem}", where)
            if file_spec is None or file_spec.loader is None or not Path(where).is_file():
                raise InvalidArgument(f"harness_reward: no file {where}")
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as exc:
        raise InvalidArgument(f"harness_reward {spec!r}: cannot import {where}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise InvalidArgument(f"harness_reward {spec!r}: {where} has no callable {name!r}")
    return fn


def _as_progress(value: Any) -> tuple[float, Progress]:
    """(reward, progress) from what a reward function returned (see RewardFn)."""
    if isinstance(value, bool) or not isinstance(value, int | float | Mapping):
        raise InvalidArgument(
            f"the reward function returned {type(value).__name__}; expected a number or a dict"
        )
    if not isinstance(value, Mapping):
        reward = float(value)
        progress = Progress()
    else:
        progress = Progress(
            milestones_reached=int(value.get("milestones_reached", 0)),
            milestones_total=int(value.get("milestones_total", 0)),
            tests_passed_fraction=(
                None if value.get("tests_passed_fraction") is None else float(value["tests_passed_fraction"])
            ),
        )
        reward = float(value["reward"]) if value.get("reward") is not None else progress.score()
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise InvalidArgument(f"the reward function returned a non-finite reward {reward}")
    return reward, progress


# -- the agent process ------------------------------------------------------------------------


@dataclass
class AgentRun:
    """How one agent process ended."""

    exit_code: int | None  # None: killed on timeout
    output: str  # stdout tail
    errors: str  # stderr tail
    wall_s: float

    @property
    def timed_out(self) -> bool:
        return self.exit_code is None


def _limit_agent(settings: HarnessSettings, uid: int | None) -> None:
    """In the child between fork and exec: rlimits (the new session comes from start_new_session).

    RLIMIT_NPROC counts per real uid, so it is set only where the uid is the agent's own.
    """
    resource.setrlimit(resource.RLIMIT_AS, (settings.memory_bytes, settings.memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (settings.cpu_s, settings.cpu_s))
    resource.setrlimit(resource.RLIMIT_NOFILE, (settings.max_open_files, settings.max_open_files))
    if uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (settings.max_processes, settings.max_processes))


def _as_user(argv: list[str], uid: int | None) -> list[str]:
    """argv run as the sandbox uid through `setpriv` (no new privileges, no supplementary groups).

    No network or PID namespace, unlike workspace commands: the agent must reach the endpoint.
    """
    if uid is None:
        return argv
    setpriv = shutil.which("setpriv") or "setpriv"
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--", *argv]


def _kill_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _is_relative_file(base: Path, arg: str) -> bool:
    if not arg or os.path.isabs(arg) or arg.startswith("-") or "\n" in arg:
        return False
    try:
        return (base / arg).is_file()
    except OSError:  # e.g. an inline script passed with -c: not a path
        return False


def resolve_command(command: list[str], base: Path | None = None) -> list[str]:
    """`{python}` -> this interpreter; an argument naming an existing file under `base` (the service's
    working directory) -> its absolute path, since the agent runs in its task's work directory."""
    base = base or Path.cwd()
    out = []
    for arg in command:
        arg = arg.replace("{python}", sys.executable)
        out.append(str((base / arg).resolve()) if _is_relative_file(base, arg) else arg)
    return out


async def _read_tail(stream: asyncio.StreamReader | None, limit: int) -> bytes:
    """Read `stream` to EOF keeping the last `limit` bytes (the rest is drained so the writer never blocks)."""
    kept = b""
    if stream is None:
        return kept
    while chunk := await stream.read(65536):
        kept = (kept + chunk)[-limit:]
    return kept


async def run_agent(
    argv: list[str],
    task_json: str,
    workdir: Path,
    env: dict[str, str],
    settings: HarnessSettings,
    user: SandboxUser,
) -> AgentRun:
    """Run the agent once as `user`: own session and process group, rlimits, stdin = the task.

    Bounded by `timeout_s`: then its group gets SIGTERM, and SIGKILL after `kill_grace_s`. When the
    agent's first process is gone (exit or kill), every process of its group and of its sandbox user
    (its uid, or its GYRE_SANDBOX marker) is SIGKILLed before this returns, so nothing it started -
    not even a `setsid` daemon holding its output pipe - outlives the execution.
    """
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *_as_user(argv, user.uid),
        cwd=str(workdir),
        env={**env, "GYRE_SANDBOX": user.marker},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        preexec_fn=functools.partial(_limit_agent, settings, user.uid),
    )
    limit = settings.max_output_bytes
    readers = [asyncio.create_task(_read_tail(s, limit)) for s in (proc.stdout, proc.stderr)]
    assert proc.stdin is not None
    try:
        proc.stdin.write(task_json.encode())
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # an agent that does not read its stdin
    # Poll the exit status: proc.wait() would also wait for pipes a leftover child may hold (3.11).
    deadline = started + settings.timeout_s
    while proc.returncode is None and time.monotonic() < deadline:  # noqa: ASYNC110 - no exit event
        await asyncio.sleep(0.05)
    timed_out = proc.returncode is None
    if timed_out:
        _kill_group(proc.pid, signal.SIGTERM)
        grace = time.monotonic() + settings.kill_grace_s
        while proc.returncode is None and time.monotonic() < grace:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    _kill_group(proc.pid, signal.SIGKILL)
    await asyncio.to_thread(kill_sandbox, user.uid, user.marker)
    await proc.wait()
    try:
        out, err = await asyncio.wait_for(asyncio.gather(*readers), 5.0)
    except TimeoutError:  # a process that escaped every kill still holds a pipe
        out, err = b"", b"(output lost: a process of the agent outlived it and holds its pipes)"
    decode = lambda b: b.decode("utf-8", errors="replace")  # noqa: E731
    return AgentRun(
        None if timed_out else proc.returncode, decode(out), decode(err), time.monotonic() - started
    )


# -- one execution ----------------------------------------------------------------------------


class ExternalHarness:
    """Runs executions as processes of the user's agent (the `Agent.run` interface of the built-in loop)."""

    def __init__(
        self,
        endpoints: ExecutionEndpoints,
        sink: StepSink,
        settings: HarnessSettings,
        reward: RewardFn | None = None,
    ) -> None:
        if not settings.command:
            raise InvalidArgument("rollout.harness_command is empty: give the agent's command line")
        self.endpoints, self.sink, self.settings, self.reward = endpoints, sink, settings, reward
        self.argv = resolve_command(settings.command)
        if shutil.which(self.argv[0]) is None:  # refused at startup, not once per execution
            raise InvalidArgument(
                f"harness_command: {settings.command[0]!r} is not an executable file or a command on PATH"
            )

    def _started(self, spec: ExecutionSpec, progress: Progress) -> events_pb2.ExecutionEvent:
        return E(
            event_id=f"{spec.execution_id}.started",
            run_id=spec.run_id,
            task_id=spec.task_id,
            group_id=spec.group_id,
            execution_id=spec.execution_id,
            kind=E.KIND_STARTED,
            progress=progress.to_proto(),
            environment=spec.environment,
            created_unix_s=time.time(),
        )

    async def score(
        self, env: Environment, task: dict[str, Any], workdir: Path, run: AgentRun
    ) -> tuple[float, Progress]:
        """(reward, progress): the reward function if configured, else the environment's own scoring."""
        if self.reward is not None:
            args = (task, str(workdir), run.output, run.exit_code)
            if inspect.iscoroutinefunction(self.reward):
                value = await self.reward(*args)
            else:
                value = await asyncio.to_thread(self.reward, *args)
            return _as_progress(value)
        score = getattr(env, "score", None)
        if callable(score):  # the workspace environment: re-run its hidden tests on the final files
            await score()
        progress = env.progress
        return progress.score(), progress

    def _payload(
        self, spec: ExecutionSpec, env: Environment, messages: list[dict[str, Any]], workdir: Path
    ) -> str:
        source = getattr(env, "task", None)
        task: dict[str, Any] = dict(getattr(source, "fields", None) or {"task_id": spec.task_id})
        if hasattr(source, "spec"):  # a workspace task: its spec (never its hidden tests or solution)
            task["spec"] = source.spec  # type: ignore[union-attr]
        return json.dumps(
            {
                "run_id": spec.run_id,
                "task_id": spec.task_id,
                "group_id": spec.group_id,
                "execution_id": spec.execution_id,
                "messages": messages,
                "task": task,
                "workdir": str(workdir),
            }
        )

    async def run(self, spec: ExecutionSpec, env: Environment) -> ExecutionOutcome:
        """One execution: the agent process from launch to exit, scored, with its final event."""
        await self.sink.publish_execution(self._started(spec, env.progress))
        out = ExecutionOutcome(kind=E.KIND_FAILED, num_calls=0, progress=env.progress)
        scratch: Path | None = None
        own_user: SandboxUser | None = None
        issued = False
        try:
            messages = await env.reset()
            ws = getattr(env, "ws", None)  # the workspace environment: its directory and sandbox user
            if ws is not None:
                workdir, user = Path(ws.root), ws.user
            else:
                user = own_user = SandboxUser()
                workdir = scratch = Path(tempfile.mkdtemp(prefix=f"gyre-agent-{spec.execution_id}-"))
                user.chown(workdir)
            tmp = workdir / ".tmp"
            tmp.mkdir(exist_ok=True)
            user.chown(tmp)
            task_json = self._payload(spec, env, messages, workdir)
            task_file = tmp / "gyre_task.json"
            task_file.write_text(task_json)
            user.chown(task_file)
            base_url, api_key = self.endpoints.issue(spec)
            issued = True
            child_env = {
                "PATH": sandbox_path(),
                "HOME": str(workdir),
                "TMPDIR": str(tmp),
                "LANG": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONUNBUFFERED": "1",
                "OPENAI_BASE_URL": base_url,
                "OPENAI_API_KEY": api_key,
                "OPENAI_MODEL": "gyre",
                "GYRE_TASK_FILE": str(task_file),
                "GYRE_EXECUTION_ID": spec.execution_id,
            }
            run = await run_agent(self.argv, task_json, workdir, child_env, self.settings, user)
            reward, out.progress = await self.score(env, json.loads(task_json)["task"], workdir, run)
            if run.timed_out:
                out.kind = E.KIND_TRUNCATED  # the trajectory service scores it from its progress
                out.error = f"agent timed out after {self.settings.timeout_s:.0f} s"
            elif run.exit_code == 0:
                out.kind, out.reward = E.KIND_FINISHED, reward
            else:
                out.kind = E.KIND_FAILED
                out.error = f"agent exited with status {run.exit_code}: {run.errors[-1500:]}"
            log.info(
                "execution %s: agent %s after %.1f s, reward %.3f",
                spec.execution_id,
                "timed out" if run.timed_out else f"exited {run.exit_code}",
                run.wall_s,
                reward,
            )
        except Exception as exc:  # this execution fails; the service lives on
            log.exception("execution %s failed", spec.execution_id)
            out.kind, out.error = E.KIND_FAILED, repr(exc)
        finally:
            await env.close()
            if own_user is not None:
                own_user.close()
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        kind = E.Kind.Name(out.kind).removeprefix("KIND_").lower()  # type: ignore[arg-type]
        if issued:  # the endpoint publishes the final event (its call count) and refuses later calls
            out.num_calls = await self.endpoints.end(spec, kind, out.reward, out.error, out.progress)
        else:
            await self.sink.publish_execution(
                E(
                    event_id=f"{spec.execution_id}.{kind}",
                    run_id=spec.run_id,
                    task_id=spec.task_id,
                    group_id=spec.group_id,
                    execution_id=spec.execution_id,
                    kind=out.kind,  # type: ignore[arg-type]
                    progress=out.progress.to_proto(),
                    environment=spec.environment,
                    error=out.error[-2000:],
                    created_unix_s=time.time(),
                )
            )
        return out


def build_external_harness(
    cfg: Any, endpoint: Any, sink: StepSink, family: TaskFamily
) -> tuple[ExternalHarness, TaskFamily]:
    """The harness and task family of `rollout.harness: external` (cfg is the RolloutConfig)."""
    settings = HarnessSettings(
        command=list(cfg.harness_command),
        timeout_s=cfg.harness_timeout_s,
        memory_bytes=cfg.harness_memory_bytes,
        cpu_s=cfg.harness_cpu_s,
        max_output_bytes=cfg.harness_max_output_bytes,
        reward=cfg.harness_reward,
    )
    reward = load_reward(cfg.harness_reward) if cfg.harness_reward else None
    if cfg.harness_tasks is not None:
        family = JsonTaskFamily.from_jsonl(cfg.harness_tasks)
    return ExternalHarness(OpenAIExecutions(endpoint), sink, settings, reward), family
