"""One child process as its own OS session and process group, with a log file and a clean stop.

This is the one process runner of Gyre: the embedded servers (gyre.embedded.nats,
gyre.embedded.postgres) and the launcher's supervised services (app.launcher.process) both run
their children through `ProcessGroup`.

Guarantees:

* the child leads its own session and process group (pgid == pid), so a terminal's Ctrl-C reaches
  only the parent, and stopping the group reaches every process the child spawned;
* stdout and stderr go to the log file (appended, one ``==== time $ cmd`` header line per start),
  never through a pipe to the parent, so a busy or dead parent never blocks the child on a full
  pipe;
* nothing outlives the parent, however it dies (SIGKILL included) and from whichever thread the
  child was started: the parent's guardian (gyre.embedded.guardian, a small reaper process that
  sees the parent die as the end of a pipe) watches every child from spawn to stop, and then sends
  it `death_signal`, SIGKILLs after the grace period what is left of its group, of its descendants
  and of every process carrying the guardian's token in its environment (GYRE_GUARDIAN, which
  every child gets); started from the main thread on Linux, the child also gets `death_signal`
  from the kernel at once (PR_SET_PDEATHSIG, which follows the forking *thread*, so only there);
* `stop(grace_s)` sends `stop_signal` (to the whole group, or to the leader only when the leader
  stops its own children, as the Postgres postmaster does), waits `grace_s` seconds, SIGKILLs the
  group, then kills what is left of the group and of the leader's descendants (also those that
  left the group) and reaps the leader, then tells the guardian to forget it. Idempotent.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

import psutil

from gyre.embedded.guardian import guardian

_PR_SET_PDEATHSIG = 1
# How long stop() waits for stragglers of the group once the leader is gone (seconds).
_STRAGGLER_GRACE_S = 5.0


def _death_signal(sig: int) -> Callable[[], None] | None:
    """preexec_fn that makes the child receive `sig` when the parent dies (Linux, main thread only:
    the signal follows the *thread* that forked, which must live as long as the child)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None

    def _set() -> None:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)

    return _set


class ProcessGroup:
    """A started child process leading its own process group (see the module docstring).

    `env` None inherits the parent's environment (either way the guardian's token is added);
    `user` runs the child as that OS user (the parent must be root); `cwd` is the child's working
    directory; `death_grace_s` is how long the guardian waits after `death_signal` before SIGKILL
    when the parent died.
    """

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        user: pwd.struct_passwd | None = None,
        stop_signal: int = signal.SIGTERM,
        death_signal: int = signal.SIGTERM,
        stop_whole_group: bool = True,
        death_grace_s: float = 10.0,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._stop_signal = stop_signal
        self._stop_whole_group = stop_whole_group
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] | None = open(log_path, "ab")  # noqa: SIM115 (closed in stop)
        self._log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} $ {' '.join(cmd)}\n".encode())
        self._log.flush()
        # Byte offset in the log where this start's output begins.
        self.log_offset: int = self._log.tell()
        as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user else {}
        self._proc: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            list(cmd),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=guardian().env(env),
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_death_signal(death_signal),
            **as_user,
        )
        # OS process id of the leader, which is also the process group id.
        self.pid: int = self._proc.pid
        guardian().watch(
            self.pid, death_signal=death_signal, whole_group=stop_whole_group, grace_s=death_grace_s
        )

    @property
    def returncode(self) -> int | None:
        """Exit status once the leader ended (negative: killed by that signal), None while it runs."""
        return self._proc.poll()

    def running(self) -> bool:
        """True while the leader has not exited."""
        return self._proc.poll() is None

    def descendants(self) -> list[psutil.Process]:
        """Every live process below the leader (empty once the leader is gone)."""
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.pid).children(recursive=True)
        return []

    def stop(self, grace_s: float) -> int | None:
        """`stop_signal`, SIGKILL after `grace_s` seconds, reap; returns the exit status. Idempotent."""
        children = self.descendants()
        if self._proc.poll() is None:
            if self._stop_whole_group:
                signal_group(self.pid, self._stop_signal)
            else:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.send_signal(self._stop_signal)
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                signal_group(self.pid, signal.SIGKILL)
                self._proc.kill()
                self._proc.wait()
        # The leader is gone; whatever is left of its group or its descendants goes too.
        if group_alive(self.pid):
            signal_group(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + min(grace_s, _STRAGGLER_GRACE_S)
            while group_alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            signal_group(self.pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(children, timeout=_STRAGGLER_GRACE_S)
        guardian().forget(self.pid)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self._proc.returncode


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to every process of group `pgid`; a group that is gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """True while some process (not a zombie) is still in process group `pgid`."""
    for proc in psutil.process_iter(["pid", "status"]):
        # A process may exit between the listing and os.getpgid (ProcessLookupError, an OSError): a
        # 50-kill soak once lost the supervisor thread to that race, and nothing restarted after it.
        with contextlib.suppress(psutil.Error, OSError):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.info["pid"]) == pgid:
                return True
    return False
