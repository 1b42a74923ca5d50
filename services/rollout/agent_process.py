"""The external agent as a process: launched as its sandbox user, bounded, and never outlived.

`run_agent` starts the agent's argv in its own session and process group with rlimits
(`RLIMIT_AS`, `RLIMIT_CPU`, `RLIMIT_NOFILE`, and `RLIMIT_NPROC` where the uid is the agent's own;
an AS or CPU limit of 0 is not set), writes the task JSON to its stdin, keeps the tails of stdout
and stderr, and waits at most `timeout_s` seconds (0: no limit; then SIGTERM to the group, SIGKILL `kill_grace_s` seconds later). When the
agent's first process is gone every process of its group and of its sandbox user is SIGKILLed
before `run_agent` returns, so nothing it started outlives the execution.

The agent is an asyncio subprocess with pipes (its output is the reward function's input), not a
log-file child of gyre.embedded.process, and it runs under rlimits and a sandbox uid.
"""

from __future__ import annotations

import asyncio
import functools
import os
import resource
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .environments.sandbox import SandboxUser, kill_sandbox


@dataclass(frozen=True)
class HarnessSettings:
    """Limits of one agent run (rollout.harness in services/rollout/config.py for the configured ones)."""

    command: list[str]  # the agent's argv as configured ({python} and relative files not resolved yet)
    timeout_s: float = 14400.0  # wall-clock seconds before the agent's group gets SIGTERM; 0 = no limit
    kill_grace_s: float = 2.0  # seconds between that SIGTERM and SIGKILL
    memory_bytes: int = 16 << 30  # RLIMIT_AS of each agent process (bytes); 0 = not set (inherited)
    cpu_s: int = 14400  # RLIMIT_CPU of each agent process (seconds); 0 = not set (inherited)
    max_open_files: int = 1024  # RLIMIT_NOFILE
    max_processes: int = 256  # RLIMIT_NPROC, set only where the agent has a uid of its own
    max_output_bytes: int = 65536  # tail of stdout and of stderr kept (bytes each)
    reward: str | None = None  # the reward function's spec (services/rollout/harness.py load_reward)


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

    RLIMIT_NPROC counts per real uid, so it is set only where the uid is the agent's own. A limit of 0
    is not set: the agent inherits the service's own (an hours-long agent may need no AS/CPU cap).
    """
    if settings.memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (settings.memory_bytes, settings.memory_bytes))
    if settings.cpu_s:
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

    Bounded by `timeout_s` (0: unbounded): then its group gets SIGTERM, and SIGKILL after `kill_grace_s`. When the
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
    deadline = started + settings.timeout_s if settings.timeout_s > 0 else float("inf")
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
