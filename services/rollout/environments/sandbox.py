"""A temp workspace directory and the only ways an agent may touch it.

Guarantees:
- File tools (`write_file`, `read_file`, `list_files`) resolve every path inside the workspace:
  absolute paths, `..` that climbs out, and symlinks (anywhere on the path) that point out are
  refused with `SandboxViolation`; writes never follow a final symlink (O_NOFOLLOW).
- Commands run with cwd = workspace, HOME/TMPDIR inside it, an environment without proxies or
  credentials, resource limits set in the child (address space, CPU seconds, file size, open
  files, processes), a wall-clock timeout that kills the whole process group, and, where
  `unshare -rn` works (Linux with user namespaces), inside a fresh network namespace with no
  interfaces but loopback-down: no network at all. Where it does not work, `network_isolated` is
  False and the lack of isolation is only the proxy-free environment (documented in docs/rollout.md).
- Commands are NOT given a private file system: a command may write wherever the OS user running
  the rollout service may. Run the service as an unprivileged user or in a container for untrusted
  code; the file tools are jailed regardless.
"""

from __future__ import annotations

import asyncio
import functools
import os
import resource
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gyre.errors import InvalidArgument


class SandboxViolation(InvalidArgument):
    """An action tried to reach outside its workspace."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one command (seconds, bytes, counts)."""

    timeout_s: float = 20.0
    cpu_s: int = 20
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    max_open_files: int = 256
    max_output_bytes: int = 8192


@functools.cache
def network_namespace_available() -> bool:
    """True if `unshare -rn` can start a process in a private network namespace here."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limit_child(limits: SandboxLimits) -> None:
    """Runs in the child between fork and exec: own process group plus rlimits."""
    os.setsid()
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_bytes, limits.file_size_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))


@dataclass
class CommandResult:
    returncode: int
    output: str
    timed_out: bool


class Workspace:
    """A private temp directory plus jailed file tools and limited commands."""

    def __init__(self, limits: SandboxLimits | None = None, prefix: str = "gyre-ws-") -> None:
        self.root = Path(tempfile.mkdtemp(prefix=prefix)).resolve()
        self.limits = limits or SandboxLimits()
        (self.root / ".tmp").mkdir()

    # -- paths -----------------------------------------------------------------------------
    def resolve(self, rel: str) -> Path:
        """The absolute path of `rel` inside the workspace, or SandboxViolation."""
        if not rel or "\x00" in rel:
            raise SandboxViolation("path must be a non-empty string without NUL bytes")
        if os.path.isabs(rel):
            raise SandboxViolation(
                f"absolute paths are not allowed: {rel!r}; use a path relative to the workspace"
            )
        target = (self.root / rel).resolve()  # follows symlinks on the way
        if target != self.root and self.root not in target.parents:
            raise SandboxViolation(f"path {rel!r} leaves the workspace")
        return target

    def write_file(self, rel: str, content: str) -> int:
        """Write text to a workspace file (parents created); returns bytes written."""
        path = self.resolve(rel)
        if path == self.root:
            raise SandboxViolation("cannot write the workspace directory itself")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.resolve(str(path.parent.relative_to(self.root)) or ".")  # parents re-checked after mkdir
        data = content.encode()
        if len(data) > self.limits.file_size_bytes:
            raise InvalidArgument(f"file too large: {len(data)} bytes > {self.limits.file_size_bytes}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return len(data)

    def read_file(self, rel: str, max_bytes: int | None = None) -> str:
        path = self.resolve(rel)
        if not path.is_file():
            raise InvalidArgument(f"no such file in the workspace: {rel!r}")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            return f.read(max_bytes or self.limits.max_output_bytes).decode("utf-8", errors="replace")

    def list_files(self) -> list[str]:
        return sorted(
            str(p.relative_to(self.root))
            for p in self.root.rglob("*")
            if p.is_file() and ".tmp" not in p.parts and "__pycache__" not in p.parts
        )

    # -- commands --------------------------------------------------------------------------
    def child_env(self) -> dict[str, str]:
        """A minimal environment: no proxies, no credentials, HOME and TMPDIR in the workspace."""
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root),
            "TMPDIR": str(self.root / ".tmp"),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": str(self.root),
        }

    async def run(
        self,
        argv: list[str],
        *,
        cwd: Path | None = None,
        timeout_s: float | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> CommandResult:
        """Run argv in the sandbox; output (stdout+stderr) truncated to max_output_bytes."""
        if network_namespace_available():
            argv = ["unshare", "-rn", *argv]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=str(cwd or self.root),
            env={**self.child_env(), **(extra_env or {})},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            preexec_fn=functools.partial(_limit_child, self.limits),
        )
        timed_out = False
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout_s or self.limits.timeout_s)
        except TimeoutError:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, _ = await proc.communicate()
        text = out[: self.limits.max_output_bytes].decode("utf-8", errors="replace")
        return CommandResult(
            returncode=proc.returncode if proc.returncode is not None else -9,
            output=text,
            timed_out=timed_out,
        )

    async def run_shell(self, command: str) -> CommandResult:
        return await self.run(["/bin/sh", "-c", command])

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
