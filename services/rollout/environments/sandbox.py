"""A workspace directory for untrusted agent code, and the only ways an agent may touch it.

Commands (and the scorer, see workspace.py) run under one of four isolation levels, the strongest
this machine allows (`isolation()`, probed once, logged):

    level            when                                  user                    network  processes
    namespaces+uid   root, `unshare` + `setpriv` work       a uid of its own (*)    none     own PID namespace
    uid              root, no usable `unshare`              a uid of its own (*)    host     killed by uid
    namespaces       not root, user namespaces work         the service's user      none     own PID namespace
    none             not root, no user namespaces           the service's user      host     killed by marker

(*) each Workspace claims a uid of its own from [SANDBOX_UID_BASE, +SANDBOX_UID_COUNT) (a flock
under a root-only directory, released on close or process death), so two workspaces never share
a user: one cannot read the other's files, and "every process of the uid" is exactly the sandbox.

Guarantees:
- Every command runs in its own session with resource limits set before exec: address space,
  CPU seconds, file size, open files and - when it has a uid of its own - processes
  (RLIMIT_NPROC counts per real uid, so it is not set where the uid is the service's own).
  `setpriv --no-new-privs` keeps setuid binaries from raising privileges.
- No process outlives its command: in a PID namespace the kernel kills every process when the
  command's first process exits (daemons that called `setsid` included); otherwise every process
  of the sandbox's uid (or carrying its environment marker) is killed after the command, at a
  timeout and on close.
- A sandbox uid can read only what "others" may read: world-readable files such as /etc/passwd
  stay readable (as for any unprivileged user), root-only files (0600, /etc/shadow) do not, and
  the workspace is 0700 to its own uid.
- File tools (`write_file`, `read_file`, `list_files`) run in this process and resolve every path
  inside the workspace: absolute paths, `..` that climbs out, and symlinks that point out are
  refused with `SandboxViolation`; writes never follow a final symlink (O_NOFOLLOW); with a uid of
  its own, a file not owned by that uid (e.g. a hard link to someone else's file) is not read.
  They run only while no sandbox process is alive, so nothing can swap a path under them.

Not isolated (documented in docs/rollout.md): the file system outside the workspace is the
host's, so a command can write wherever its user may (world-writable /tmp, /dev/shm); at levels
`namespaces` and `none` that user is the service's own (run the service unprivileged or in a
container); at levels `uid` and `none` commands share the host network.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
import os
import resource
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gyre.errors import InvalidArgument

log = logging.getLogger(__name__)

#: First uid handed to sandboxes when the service runs as root, and how many there are.
SANDBOX_UID_BASE = 61000
SANDBOX_UID_COUNT = 4000

Isolation = Literal["namespaces+uid", "uid", "namespaces", "none"]


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
    max_processes: int = 64  # RLIMIT_NPROC of the sandbox uid (levels with a uid of its own)


def _ns_wrapper(uid: int | None) -> list[str]:
    """argv prefix that runs a command in fresh network + PID (+ mount, for /proc) namespaces."""
    unshare = shutil.which("unshare") or "unshare"
    ns = [unshare, "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if uid is None:
        return [ns[0], "--map-root-user", *ns[1:], "--"]
    setpriv = shutil.which("setpriv") or "setpriv"
    ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]
    return [*ns, "--", setpriv, *ids, "--"]


def _setuid(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _kill_all_as(uid: int) -> None:
    """In a forked child: become `uid`, then SIGKILL every process of that uid (kill(-1) spares only
    the caller, which then execs and exits)."""
    _setuid(uid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)


@functools.cache
def isolation() -> Isolation:
    """The strongest isolation level this process can give (see the module docstring); probed once."""
    root = os.geteuid() == 0
    probe_uid = SANDBOX_UID_BASE if root else None
    try:
        ok = (
            subprocess.run([*_ns_wrapper(probe_uid), "true"], capture_output=True, timeout=10).returncode == 0
        )
    except (OSError, subprocess.SubprocessError):
        ok = False
    if ok:
        level: Isolation = "namespaces+uid" if root else "namespaces"
    elif root:
        level = "uid"
    else:
        level = "none"
    log.info("workspace sandbox isolation: %s", level)
    return level


@functools.cache
def _uid_can_exec(program: str) -> bool:
    """Whether a sandbox uid can run the Python `program` and import pytest with it (probed once)."""
    try:
        argv = [*_ns_wrapper(SANDBOX_UID_BASE), program, "-I", "-c", "import pytest"]
        ok = subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        log.warning(
            "sandbox: uid %d cannot execute %s (a directory above it is closed to other users); the "
            "scorer runs as this service's user in fresh namespaces. Install Gyre where other users may "
            "enter (e.g. chmod o+x on its parent directories) for a scorer with a uid of its own.",
            SANDBOX_UID_BASE,
            program,
        )
    return ok


def network_namespace_available() -> bool:
    """True if sandboxed commands run without network (a network namespace of their own)."""
    return isolation() in ("namespaces+uid", "namespaces")


# -- processes -------------------------------------------------------------------------------------
def _proc_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _real_uid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _has_marker(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


def sandbox_pids(uid: int | None, marker: str) -> list[int]:
    """Live processes of a sandbox: those of its uid if it has one, else those carrying its marker."""
    me = os.getpid()
    if uid is not None:
        return [p for p in _proc_pids() if p != me and _real_uid(p) == uid]
    mark = f"GYRE_SANDBOX={marker}".encode()
    return [p for p in _proc_pids() if p != me and _has_marker(p, mark)]


def kill_sandbox(uid: int | None, marker: str, *, rounds: int = 20) -> int:
    """SIGKILL every process of the sandbox, repeating while new ones appear; returns how many remain.

    With a uid, a child that became that uid sends `kill(-1)`: every process of the uid at once, so
    a fork loop cannot outrun it one pid at a time.
    """
    remaining = sandbox_pids(uid, marker)
    for _ in range(rounds):
        if not remaining:
            return 0
        if uid is not None:
            subprocess.run(  # the kill happens in the child, before it execs /bin/true (coreutils)
                ["/bin/true"],
                preexec_fn=functools.partial(_kill_all_as, uid),
                capture_output=True,
                check=False,
            )
        else:
            for pid in remaining:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
        remaining = sandbox_pids(uid, marker)
    return len(remaining)


class UidLease:
    """A sandbox uid held by this process (an exclusive flock on `<lock dir>/<uid>`)."""

    def __init__(self, uid: int, fd: int) -> None:
        self.uid, self._fd = uid, fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = -1


def _lock_dir() -> Path:
    path = Path(tempfile.gettempdir()) / "gyre-sandbox-uids"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
        raise InvalidArgument(f"{path} must be a directory owned by root with mode 0700; remove it")
    return path


def claim_uid() -> UidLease:
    """A uid no other workspace (of any process on this machine) holds; its leftovers killed first."""
    locks = _lock_dir()
    start = secrets.randbelow(SANDBOX_UID_COUNT)
    for i in range(SANDBOX_UID_COUNT):
        uid = SANDBOX_UID_BASE + (start + i) % SANDBOX_UID_COUNT
        fd = os.open(locks / str(uid), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        kill_sandbox(uid, "")
        return UidLease(uid, fd)
    raise InvalidArgument(f"all {SANDBOX_UID_COUNT} sandbox uids are in use")


def _limit_child(limits: SandboxLimits, nproc: bool, setuid_to: int | None) -> None:
    """Runs in the child between fork and exec: own session, rlimits, then (level `uid`) the uid."""
    os.setsid()
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_bytes, limits.file_size_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
    if nproc:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
    if setuid_to is not None:
        _setuid(setuid_to)


async def _read_capped(stream: asyncio.StreamReader, limit: int) -> bytes:
    """Read `stream` to EOF, keeping the first `limit` bytes (the rest is drained so writers never block)."""
    kept = bytearray()
    while chunk := await stream.read(65536):
        if len(kept) < limit:
            kept += chunk[: limit - len(kept)]
    return bytes(kept)


def sandbox_path() -> str:
    """PATH of sandboxed commands: this interpreter's directory, then the system's (not the service's
    own PATH, which may name directories a sandbox user cannot enter)."""
    return f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"


@dataclass
class CommandResult:
    returncode: int
    output: str
    timed_out: bool


class SandboxUser:
    """Who sandboxed processes run as: a claimed uid (root) or this user plus an environment marker."""

    def __init__(self, interpreter: str | None = None) -> None:
        """`interpreter`: a program this user must be able to execute (the scorer's Python). When the
        sandbox uid cannot reach it (a venv under a directory only its owner may enter), the processes
        run as this service's own user instead, still in fresh namespaces, and a warning says so."""
        self.level = isolation()
        if interpreter is not None and self.level == "namespaces+uid" and not _uid_can_exec(interpreter):
            self.level = "namespaces"
        self.lease = claim_uid() if self.level in ("namespaces+uid", "uid") else None
        self.marker = secrets.token_hex(8)

    @property
    def uid(self) -> int | None:
        return self.lease.uid if self.lease is not None else None

    def chown(self, path: Path | int) -> None:
        """Give `path` (or an open fd) to the sandbox uid; a no-op without a uid of its own."""
        if self.uid is None:
            return
        if isinstance(path, int):
            os.fchown(path, self.uid, self.uid)
        else:
            os.chown(path, self.uid, self.uid, follow_symlinks=False)

    async def run(
        self, argv: list[str], *, cwd: Path, env: dict[str, str], limits: SandboxLimits, timeout_s: float
    ) -> CommandResult:
        """Run argv as this user under `limits`; every process it left is killed before this returns."""
        env = {**env, "GYRE_SANDBOX": self.marker}
        uid = self.uid
        if self.level in ("namespaces+uid", "namespaces"):
            argv = [*_ns_wrapper(uid), *argv]
        setuid_to = uid if self.level == "uid" else None
        preexec: Callable[[], None] = functools.partial(_limit_child, limits, uid is not None, setuid_to)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=str(cwd),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            preexec_fn=preexec,
        )
        assert proc.stdout is not None
        reader = asyncio.create_task(_read_capped(proc.stdout, limits.max_output_bytes))
        # Poll the exit status: asyncio's proc.wait() would also wait for the pipe to close (3.11).
        deadline = time.monotonic() + timeout_s
        while proc.returncode is None and time.monotonic() < deadline:  # noqa: ASYNC110 - no exit event
            await asyncio.sleep(0.02)
        timed_out = proc.returncode is None
        # The command is over (or out of time): nothing of it may live on, even what still holds its
        # output pipe open (a background job, a `setsid` daemon).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(kill_sandbox, uid, self.marker)
        await proc.wait()
        try:
            out = await asyncio.wait_for(reader, 5.0)
        except TimeoutError:  # a process that escaped the kill still holds the pipe (level `none`)
            out = b""
            log.error("sandbox %s: a process outlived its command and holds its output", self.marker)
        text = out[: limits.max_output_bytes].decode("utf-8", errors="replace")
        return CommandResult(proc.returncode if proc.returncode is not None else -9, text, timed_out)

    def close(self) -> None:
        """Kill every process of this user and give its uid back."""
        left = kill_sandbox(self.uid, self.marker)
        if left:
            log.error("sandbox uid %s: %d processes survived SIGKILL", self.uid, left)
        if self.lease is not None:
            self.lease.release()


class Workspace:
    """A private directory (0700, owned by the sandbox user) plus jailed file tools and limited commands."""

    def __init__(self, limits: SandboxLimits | None = None, prefix: str = "gyre-ws-") -> None:
        self.limits = limits or SandboxLimits()
        self.user = SandboxUser()
        self.root = Path(tempfile.mkdtemp(prefix=prefix)).resolve()
        self.user.chown(self.root)
        (self.root / ".tmp").mkdir()
        self.user.chown(self.root / ".tmp")

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

    def _mkdirs(self, directory: Path) -> None:
        """Create `directory` (inside the root) and missing parents, each owned by the sandbox user."""
        missing = []
        while directory != self.root and not directory.exists():
            missing.append(directory)
            directory = directory.parent
        for d in reversed(missing):
            d.mkdir()
            self.user.chown(d)

    def write_file(self, rel: str, content: str) -> int:
        """Write text to a workspace file (parents created); returns bytes written."""
        path = self.resolve(rel)
        if path == self.root:
            raise SandboxViolation("cannot write the workspace directory itself")
        data = content.encode()
        if len(data) > self.limits.file_size_bytes:
            raise InvalidArgument(f"file too large: {len(data)} bytes > {self.limits.file_size_bytes}")
        self._mkdirs(path.parent)
        self.resolve(str(path.parent.relative_to(self.root)) or ".")  # parents re-checked after mkdir
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            self.user.chown(f.fileno())
            f.write(data)
        return len(data)

    def open_owned(self, path: Path) -> int:
        """An O_RDONLY fd of a regular workspace file the sandbox user owns (else InvalidArgument)."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (self.user.uid is not None and st.st_uid != self.user.uid):
            os.close(fd)
            raise SandboxViolation(f"{path.name!r} is not a regular file of the workspace's own")
        return fd

    def read_file(self, rel: str, max_bytes: int | None = None) -> str:
        path = self.resolve(rel)
        if not path.is_file():
            raise InvalidArgument(f"no such file in the workspace: {rel!r}")
        with os.fdopen(self.open_owned(path), "rb") as f:
            return f.read(max_bytes or self.limits.max_output_bytes).decode("utf-8", errors="replace")

    def list_files(self) -> list[str]:
        return sorted(
            str(p.relative_to(self.root))
            for p in self.root.rglob("*")
            if p.is_file() and ".tmp" not in p.parts and "__pycache__" not in p.parts
        )

    def copy_files_to(self, dest: Path) -> int:
        """Copy the workspace's own regular files (no symlinks, no foreign files) into `dest`; count."""
        copied = 0
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            rel_dir = Path(dirpath).relative_to(self.root)
            dirnames[:] = [d for d in dirnames if d not in (".tmp", "__pycache__")]
            for name in filenames:
                try:
                    fd = self.open_owned(Path(dirpath) / name)
                except (OSError, SandboxViolation):
                    continue
                target = dest / rel_dir / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with os.fdopen(fd, "rb") as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                copied += 1
        return copied

    # -- commands --------------------------------------------------------------------------
    def child_env(self) -> dict[str, str]:
        """A minimal environment: no proxies, no credentials, HOME and TMPDIR in the workspace."""
        return {
            "PATH": sandbox_path(),
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
        return await self.user.run(
            argv,
            cwd=cwd or self.root,
            env={**self.child_env(), **(extra_env or {})},
            limits=self.limits,
            timeout_s=timeout_s or self.limits.timeout_s,
        )

    async def run_shell(self, command: str) -> CommandResult:
        return await self.run(["/bin/sh", "-c", command])

    def close(self) -> None:
        """Kill every process of the sandbox, delete the workspace, give the uid back."""
        self.user.close()
        shutil.rmtree(self.root, ignore_errors=True)
