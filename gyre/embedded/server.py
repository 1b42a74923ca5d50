"""What the embedded servers share: a free port, and a child server process that always stops.

An `EmbeddedServer` runs its process through the one process runner (gyre.embedded.process), is a
context manager, and registers its stop() at interpreter exit, so no server outlives the process
that started it.
"""

from __future__ import annotations

import atexit
import pwd
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from gyre.embedded.ports import free_port
from gyre.embedded.process import ProcessGroup


class EmbeddedServer:
    """A server child process with a log file and a stop() that always reaps it.

    Subclasses choose the graceful `stop_signal` and the `death_signal` the server gets when its
    parent dies, and call `_spawn` from their start().
    """

    def __init__(self, name: str, *, stop_signal: int, death_signal: int, stop_whole_group: bool) -> None:
        self._name = name
        self._group: ProcessGroup | None = None
        self._stop_signal = stop_signal
        self._death_signal = death_signal
        self._stop_whole_group = stop_whole_group
        atexit.register(self.stop)

    @property
    def pid(self) -> int | None:
        """OS process id of the server while it runs."""
        return self._group.pid if self._group is not None and self._group.running() else None

    def _spawn(
        self,
        cmd: Sequence[str],
        log_path: Path,
        *,
        cwd: str | Path | None = None,
        user: pwd.struct_passwd | None = None,
    ) -> None:
        self._group = ProcessGroup(
            self._name,
            cmd,
            log_path,
            cwd=cwd,
            user=user,
            stop_signal=self._stop_signal,
            death_signal=self._death_signal,
            stop_whole_group=self._stop_whole_group,
        )

    def _exited(self) -> bool:
        return self._group is None or not self._group.running()

    def stop(self, timeout_s: float = 20.0) -> None:
        """Graceful shutdown, SIGKILL after `timeout_s` seconds; always reaps the process. Idempotent."""
        group, self._group = self._group, None
        if group is not None:
            group.stop(timeout_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


__all__ = ["EmbeddedServer", "free_port"]
