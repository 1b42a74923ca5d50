"""The guardian: a small reaper process that outlives its parent by moments and kills what it left.

A parent-death signal (PR_SET_PDEATHSIG) follows the *thread* that forked the child: a process the
launcher's supervisor thread restarted got none, and outlived a killed launcher (issue 49). The
guardian does not depend on threads, signals or the parent's cooperation:

    parent (launcher, test, service) ──pipe (write end)──▶ guardian (`python guardian.py TOKEN`)
        │  spawns children through ProcessGroup              │  reads "watch"/"forget" lines;
        │  (own process group; env GYRE_GUARDIAN += TOKEN)   │  every second, remembers the
        └────────────────────────────────────────────────────┘  descendants of what it watches

The write end lives only in the parent (close-on-exec, and closed in a child forked without
exec), so the pipe reaches end-of-file when the parent dies, however it dies: SIGKILL, OOM, a
crash. The guardian then

1. sends each watched process its death signal (to its whole process group, or to the leader only
   where the leader stops its own children, as the Postgres postmaster does on SIGQUIT) and waits
   up to the largest grace period of what it watched (at most `MAX_GRACE_S`);
2. SIGKILLs, until nothing is found (at most `KILL_DEADLINE_S`): every process whose environment
   carries its token in GYRE_GUARDIAN (every child of a ProcessGroup and all it forked, e.g. the
   Postgres backends, which call setsid() and so leave the postmaster's group), every member of a
   watched process group, every remembered descendant still alive (same pid *and* start time: a
   reused pid is never killed), and the descendants of all these;
3. exits.

A parent that stopped its children itself (ProcessGroup.stop) has sent "forget" for each: the
guardian finds nothing and exits at once. The guardian runs in its own session (a terminal's
Ctrl-C, or `timeout` signalling its process group, does not reach it) and ignores SIGINT, SIGTERM
and SIGHUP: only the pipe's end (or SIGKILL) ends it. It also reaps when its parent pid changes,
in case some process inherited the write end by a path this module does not know of.

This file runs as a script (no package imports, so the guardian starts in a fraction of a second)
and is imported by gyre.embedded.process, which starts one guardian per parent process on first use.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import IO, Any

import psutil

# Environment variable of every guarded child: the tokens of the guardians that watch it, ':'-joined
# (a child of a child keeps its ancestors' tokens, so each guardian up the chain finds it).
ENV_VAR = "GYRE_GUARDIAN"
# Longest graceful wait after the death signals (seconds); then SIGKILL.
MAX_GRACE_S = 15.0
# Longest the SIGKILL sweeps go on (seconds).
KILL_DEADLINE_S = 30.0
# How often the guardian remembers the descendants of what it watches (seconds).
POLL_S = 1.0


# -- in the parent ----------------------------------------------------------------------------


class Guardian:
    """The parent's handle on its guardian process: `watch` a child, `forget` it once stopped.

    One per process (`guardian()`); started on first use and started again, with everything still
    watched, if it died. Thread-safe.
    """

    def __init__(self) -> None:
        self.token = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._pipe: IO[bytes] | None = None
        self._watched: dict[int, dict[str, Any]] = {}  # pid -> the watch message sent for it

    @property
    def pid(self) -> int | None:
        """OS process id of the guardian while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this process's environment) with this guardian's token added to ENV_VAR,
        for a child about to be spawned; starts the guardian if it is not running, so a parent that
        dies between the spawn and its `watch` still leaves no child behind."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None or self._pipe is None:
                self._send([])
        env = dict(os.environ if base is None else base)
        chain = [t for t in env.get(ENV_VAR, "").split(":") if t]
        env[ENV_VAR] = ":".join([*chain, self.token] if self.token not in chain else chain)
        return env

    def watch(self, pid: int, *, death_signal: int, whole_group: bool, grace_s: float) -> None:
        """Kill process `pid` (and its group when `whole_group`, and what it spawned) if this
        process dies before `forget(pid)`: `death_signal` first, SIGKILL after `grace_s` seconds."""
        message = {
            "op": "watch",
            "pid": pid,
            "sig": int(death_signal),
            "group": whole_group,
            "grace_s": grace_s,
        }
        with self._lock:
            self._watched[pid] = message
            self._send([message])

    def forget(self, pid: int) -> None:
        """`pid` was stopped by its owner: nothing left to do for it."""
        with self._lock:
            if self._watched.pop(pid, None) is not None:
                self._send([{"op": "forget", "pid": pid}])

    def _send(self, messages: Iterable[dict[str, Any]]) -> None:
        """Write `messages`, (re)starting the guardian first if it is not running (caller holds the lock)."""
        if self._proc is None or self._proc.poll() is not None or self._pipe is None:
            self._start()
            messages = list(self._watched.values())  # a new guardian learns everything still watched
        assert self._pipe is not None
        data = b"".join(json.dumps(m).encode() + b"\n" for m in messages)
        try:
            self._pipe.write(data)
        except BrokenPipeError:  # it died just now: a new one gets everything
            self._start()
            self._pipe.write(b"".join(json.dumps(m).encode() + b"\n" for m in self._watched.values()))

    def _start(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()
            self._proc.wait()
        env = {k: v for k, v in os.environ.items() if k != ENV_VAR or self.token not in v}
        self._proc = subprocess.Popen(
            # -P: the script's directory (gyre/embedded) does not go first on sys.path
            [sys.executable, "-P", os.path.abspath(__file__), self.token, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=None,  # its rare complaints go where the parent's do
            env=env,
            start_new_session=True,
            bufsize=0,
        )
        self._pipe = self._proc.stdin

    def close(self, timeout_s: float = MAX_GRACE_S + KILL_DEADLINE_S) -> None:
        """Close the pipe and wait (at most `timeout_s`) until the guardian has done its work and
        exited: at this process's normal exit, so that whoever waits for this process finds
        nothing of it left once it has exited."""
        with self._lock:
            proc, pipe, self._proc, self._pipe = self._proc, self._pipe, None, None
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout_s)

    def _close_in_fork_child(self) -> None:
        """A child forked without exec must not keep the write end open (the guardian would never
        see the parent die) nor share this guardian (its children get one of their own)."""
        with contextlib.suppress(OSError):
            if self._pipe is not None:
                self._pipe.close()
        self._pipe = None
        self._proc = None
        self._watched = {}


_guardian: Guardian | None = None
_guardian_lock = threading.Lock()


def guardian() -> Guardian:
    """This process's guardian handle (the process itself starts on the first `watch`)."""
    global _guardian
    with _guardian_lock:
        if _guardian is None:
            _guardian = Guardian()
        return _guardian


def _after_fork_in_child() -> None:
    global _guardian
    if _guardian is not None:
        _guardian._close_in_fork_child()
        _guardian = None


def _close_at_exit() -> None:
    if _guardian is not None:
        _guardian.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
# Registered at import, before any EmbeddedServer registers its stop(): atexit runs handlers last
# in, first out, so servers stop gracefully before the guardian is told this process is done.
atexit.register(_close_at_exit)


# -- in the guardian process ------------------------------------------------------------------


def _carries(proc: psutil.Process, token: str) -> bool:
    with contextlib.suppress(psutil.Error, OSError):
        return token in proc.environ().get(ENV_VAR, "").split(":")
    return False


def _same(pid: int, create_time: float) -> psutil.Process | None:
    """The process `pid` if it is still the one started at `create_time` (not a reused pid)."""
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    return None


class _Watch:
    """What the guardian process knows: the watched processes and their remembered descendants."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.watched: dict[int, tuple[float, dict[str, Any]]] = {}  # pid -> (start time, message)
        # watched pid -> its descendants seen so far (pid -> start time); dropped with the watch
        self.descendants: dict[int, dict[int, float]] = {}

    def apply(self, message: dict[str, Any]) -> None:
        pid = int(message["pid"])
        if message["op"] == "forget":
            self.watched.pop(pid, None)
            self.descendants.pop(pid, None)
            return
        with contextlib.suppress(psutil.Error):
            self.watched[pid] = (psutil.Process(pid).create_time(), message)

    def remember(self) -> None:
        """Remember the live descendants of every watched process; forget those that ended (one
        scan of the process table, whatever the number of watched processes)."""
        started_at: dict[int, float] = {}
        children: dict[int, list[int]] = {}
        for proc in psutil.process_iter(["pid", "ppid", "create_time"]):
            started_at[proc.info["pid"]] = proc.info["create_time"] or 0.0
            children.setdefault(proc.info["ppid"] or 0, []).append(proc.info["pid"])

        def alive(pid: int, created: float) -> bool:
            return abs(started_at.get(pid, -1.0) - created) < 0.01

        for pid, (created, _) in self.watched.items():
            seen = {p: t for p, t in self.descendants.get(pid, {}).items() if alive(p, t)}
            stack = list(children.get(pid, [])) if alive(pid, created) else []
            while stack:
                child = stack.pop()
                if child not in seen:
                    seen[child] = started_at[child]
                    stack += children.get(child, [])
            self.descendants[pid] = seen

    def signal_watched(self) -> float:
        """Send each watched process its death signal; returns the longest grace period asked for."""
        grace = 0.0
        for pid, (started, message) in self.watched.items():
            if _same(pid, started) is None and not message["group"]:
                continue
            with contextlib.suppress(OSError):
                if message["group"]:
                    os.killpg(pid, message["sig"])
                else:
                    os.kill(pid, message["sig"])
            grace = max(grace, float(message["grace_s"]))
        return min(grace, MAX_GRACE_S)

    def _signalled_alive(self) -> bool:
        """True while a process that got a death signal (a watched leader, or a member of a watched
        group) still runs."""
        groups = {pid for pid, (_, m) in self.watched.items() if m["group"]}
        if any(_same(pid, started) is not None for pid, (started, _) in self.watched.items()):
            return True
        for proc in psutil.process_iter(["pid", "status"]):
            with contextlib.suppress(psutil.Error, OSError):
                if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.info["pid"]) in groups:
                    return True
        return False

    def victims(self) -> dict[int, psutil.Process]:
        """Every live process this guardian is responsible for (module docstring, step 2)."""
        me = os.getpid()
        groups = {pid for pid, (_, m) in self.watched.items() if m["group"]}
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["pid", "status"]):
            pid = proc.info["pid"]
            if pid == me or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(pid) in groups or _carries(proc, self.token):
                    found[pid] = proc
        remembered = [(p, t) for seen in self.descendants.values() for p, t in seen.items()]
        for pid, started in [*remembered, *((p, s) for p, (s, _) in self.watched.items())]:
            proc = _same(pid, started)
            if proc is not None:
                found[pid] = proc
        for proc in list(found.values()):
            with contextlib.suppress(psutil.Error):
                for child in proc.children(recursive=True):
                    found[child.pid] = child
        found.pop(me, None)
        return found

    def reap(self) -> None:
        """The parent is gone: death signals, grace, then SIGKILL until nothing is left."""
        if not self.watched and not self.victims():
            return
        grace = self.signal_watched()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self._signalled_alive():
            time.sleep(0.1)
        deadline = time.monotonic() + KILL_DEADLINE_S
        while time.monotonic() < deadline:
            found = self.victims()
            if not found:
                return
            for proc in found.values():
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(list(found.values()), timeout=0.5)


def main(argv: list[str]) -> int:
    token, parent = argv[0], int(argv[1])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    state = _Watch(token)
    fd = sys.stdin.fileno()
    buffer = b""
    remembered = 0.0
    while True:
        readable, _, _ = select.select([fd], [], [], POLL_S)
        if readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                break  # the parent is gone
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError, KeyError):
                    state.apply(json.loads(line))
        if os.getppid() != parent:
            break
        if time.monotonic() - remembered >= POLL_S:
            state.remember()
            remembered = time.monotonic()
    state.reap()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
