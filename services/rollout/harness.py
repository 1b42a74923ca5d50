"""External harness mode (`rollout.harness.kind: external`): every execution is one run of the user's agent.

    ExecutionManager.start_group -> for each execution: ExternalHarness.run(spec, env)
        ExecutionEvent STARTED; env.reset()       -> the task (opening messages, task fields)
        issue_execution_endpoint(...)             -> (OPENAI_BASE_URL, OPENAI_API_KEY) of THIS execution
                                                     (and ANTHROPIC_BASE_URL / _API_KEY / _AUTH_TOKEN)
        run_agent (agent_process.py): launch `harness.command` as the sandbox user
            (own process group, rlimits, cwd = work directory)
            stdin: the task as one JSON object; the same JSON in the file $GYRE_TASK_FILE
            every model call it makes -> the OpenAI endpoint -> router -> StepEvent (call_seq 0..n-1)
        wait for its exit, at most `harness.timeout_s` (then SIGTERM, then SIGKILL to the whole group)
        score: the reward callable (`harness.reward`, load_reward below) or the environment's own
            tests / milestones (tasks of a JSONL file: environments/json_tasks.py)
        endpoint.end(...) -> ExecutionEvent FINISHED (exit 0) | TRUNCATED (timed out) | FAILED
            (non-zero exit) with reward and progress; later calls with that URL or key get 409/401.
            The trajectory service scores and trains it like any execution

The agent needs nothing from Gyre: the key names the execution, so an agent written against the
official `openai` client (which reads OPENAI_BASE_URL / OPENAI_API_KEY), or against the official
`anthropic` client (ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY or ANTHROPIC_AUTH_TOKEN, on the same
execution's `/v1/messages`), lands in one execution of the right group. The agent's input contract (docs/rollout.md, "External harness"):

    stdin / $GYRE_TASK_FILE: {"run_id", "task_id", "group_id", "execution_id",
                              "messages": [opening chat messages], "task": {task fields},
                              "workdir": cwd of the process}
    environment: OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL ("gyre"; any name is accepted),
                 ANTHROPIC_BASE_URL (OPENAI_BASE_URL without `/v1`), ANTHROPIC_API_KEY and
                 ANTHROPIC_AUTH_TOKEN (the same per-execution token), ANTHROPIC_MODEL ("gyre"),
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
import importlib
import importlib.util
import inspect
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from gyre.errors import InvalidArgument
from gyre.v1 import events_pb2

from .agent import ExecutionOutcome, ExecutionSpec
from .agent_process import AgentRun, HarnessSettings, resolve_command, run_agent
from .config import HarnessConfig
from .environments.base import Environment, Progress, TaskFamily
from .environments.json_tasks import JsonTaskFamily
from .environments.sandbox import SandboxUser, sandbox_path
from .steps import StepSink

log = logging.getLogger(__name__)

E = events_pb2.ExecutionEvent

RewardFn = Callable[..., Any]
"""`fn(task: dict, workdir: str, output: str, exit_code: int | None) -> float | dict` (or async).

A float is the reward. A dict may hold `reward`, `milestones_reached`, `milestones_total`,
`tests_passed_fraction`; without `reward` the reward is the partial score of those signals
(tests fraction, else milestone fraction). `output` is the agent's stdout (tail, at most
`harness.max_output_bytes`); `exit_code` is None when the agent timed out.
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


# -- reward -----------------------------------------------------------------------------------


def load_reward(spec: str) -> RewardFn:
    """The callable named by `module.path:function`, `module.path.function` or `path/to/file.py:function`."""
    if ":" in spec:
        where, name = spec.rsplit(":", 1)
    else:
        where, _, name = spec.rpartition(".")
    if not where or not name:
        raise InvalidArgument(f"harness.reward {spec!r}: use 'package.module:function' or 'file.py:function'")
    try:
        if where.endswith(".py"):
            file_spec = importlib.util.spec_from_file_location(f"gyre_reward_{Path(where).stem}", where)
            if file_spec is None or file_spec.loader is None or not Path(where).is_file():
                raise InvalidArgument(f"harness.reward: no file {where}")
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as exc:
        raise InvalidArgument(f"harness.reward {spec!r}: cannot import {where}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise InvalidArgument(f"harness.reward {spec!r}: {where} has no callable {name!r}")
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
            raise InvalidArgument("rollout.harness.command is empty: give the agent's command line")
        self.endpoints, self.sink, self.settings, self.reward = endpoints, sink, settings, reward
        self.argv = resolve_command(settings.command)
        if shutil.which(self.argv[0]) is None:  # refused at startup, not once per execution
            raise InvalidArgument(
                f"harness.command: {settings.command[0]!r} is not an executable file or a command on PATH"
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
                # the same execution for an Anthropic client (it appends /v1/messages itself)
                "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
                "ANTHROPIC_API_KEY": api_key,
                "ANTHROPIC_AUTH_TOKEN": api_key,
                "ANTHROPIC_MODEL": "gyre",
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
    cfg: HarnessConfig, endpoint: Any, sink: StepSink, family: TaskFamily
) -> tuple[ExternalHarness, TaskFamily]:
    """The harness and task family of `rollout.harness.kind: external` (`cfg` is rollout.harness)."""
    settings = HarnessSettings(
        command=list(cfg.command),
        timeout_s=cfg.timeout_s,
        memory_bytes=cfg.memory_bytes,
        cpu_s=cfg.cpu_limit_s(),
        max_output_bytes=cfg.max_output_bytes,
        reward=cfg.reward,
    )
    reward = load_reward(cfg.reward) if cfg.reward else None
    if cfg.tasks is not None:
        family = JsonTaskFamily.from_jsonl(cfg.tasks)
    return ExternalHarness(OpenAIExecutions(endpoint), sink, settings, reward), family
