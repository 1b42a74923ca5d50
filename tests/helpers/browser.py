"""Headless Chromium for the dashboard's browser test: the DOM a page ends up with, and screenshots.

Debian's `chromium` (scripts/install_browser.sh puts it there; `make test` runs that first), one
fresh profile per call, no driver package: `dump_dom` and `screenshot` use its command line
(`--dump-dom`, `--screenshot`); `screenshot_element` speaks the DevTools protocol over the pipe
`--remote-debugging-pipe` opens (file descriptors 3 and 4, NUL-terminated JSON messages), because
a `--screenshot` of a `#fragment` scrolled further down comes out blank in this headless mode.
Where Chromium is absent, `require_chromium()` skips the test and says how to get it.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

DEBIAN_PATH = Path("/usr/bin/chromium")
TIMEOUT_S = 60.0
VIRTUAL_TIME_BUDGET_MS = 3000  # lets the page's own script run before the DOM is dumped
FLAGS = (
    "--headless",
    "--no-sandbox",  # root in a container has no user namespace for the sandbox
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def find_chromium() -> Path | None:
    """Chromium's executable on this machine, or None."""
    found = shutil.which("chromium")
    if found:
        return Path(found)
    return DEBIAN_PATH if DEBIAN_PATH.is_file() else None


def require_chromium() -> Path:
    """Chromium's executable; skips the calling test, saying why and how, when there is none."""
    found = find_chromium()
    if found is None:
        pytest.skip(
            "no headless Chromium on this machine: run scripts/install_browser.sh (needs root and apt)"
        )
    return found


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    chromium = require_chromium()
    with tempfile.TemporaryDirectory(prefix="gyre-chromium-") as profile:
        proc = subprocess.run(
            [str(chromium), *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"chromium exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


def dump_dom(url: str) -> str:
    """The page's DOM as HTML after it loaded and its scripts ran (redirects and cookies followed)."""
    return _run([f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}", "--dump-dom", url]).stdout


def screenshot(url: str, path: Path, width: int, height: int) -> Path:
    """A PNG of the page's first `width` x `height` pixels (after a `#fragment`'s scroll) at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _run(
        [
            f"--screenshot={path}",
            f"--window-size={width},{height}",
            "--hide-scrollbars",
            f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}",
            url,
        ]
    )
    if not path.is_file():
        raise RuntimeError(f"chromium wrote no screenshot at {path}")
    return path


class _DevTools:
    """A Chromium started with `--remote-debugging-pipe`, and one page of it to send commands to."""

    def __init__(self, chromium: Path, profile: str, width: int, height: int) -> None:
        to_chromium, self._write = os.pipe()
        self._read, from_chromium = os.pipe()
        # Chromium reads fd 3 and writes fd 4: bash puts the pipe ends there and execs it (no Python
        # between fork and exec); the ends are first moved to 10 and up, clear of 3 and 4 (bash, not
        # sh: dash refuses descriptors above 9)
        inbound = fcntl.fcntl(to_chromium, fcntl.F_DUPFD_CLOEXEC, 10)
        outbound = fcntl.fcntl(from_chromium, fcntl.F_DUPFD_CLOEXEC, 10)
        for fd in (to_chromium, from_chromium):
            os.close(fd)
        command = [
            str(chromium),
            *FLAGS,
            f"--user-data-dir={profile}",
            "--remote-debugging-pipe",
            f"--window-size={width},{height}",
            "--hide-scrollbars",
            "about:blank",
        ]
        try:
            self.proc = subprocess.Popen(
                ["bash", "-c", f'exec "$@" 3<&{inbound} 4>&{outbound}', "bash", *command],
                pass_fds=(inbound, outbound),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        finally:
            os.close(inbound)
            os.close(outbound)
        self._buffer = b""
        self._last_id = 0
        self._deadline = time.monotonic() + TIMEOUT_S
        try:
            targets = self.call("Target.getTargets")["targetInfos"]
            page = next(t["targetId"] for t in targets if t["type"] == "page")
            self.session = self.call("Target.attachToTarget", {"targetId": page, "flatten": True})[
                "sessionId"
            ]
        except BaseException:
            self.close()
            raise

    def _next_message(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = self._deadline - time.monotonic()
            ready, _, _ = select.select([self._read], [], [], max(0.0, left))
            if not ready:
                raise TimeoutError(f"chromium did not answer within {TIMEOUT_S:.0f} s")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium closed its DevTools pipe (exit {self.proc.poll()})")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    def call(self, method: str, params: dict[str, Any] | None = None, *, page: bool = False) -> Any:
        """Send one command (to the page's session with `page`) and return its result."""
        self._last_id += 1
        message: dict[str, Any] = {"id": self._last_id, "method": method, "params": params or {}}
        if page:
            message["sessionId"] = self.session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._next_message()
            if reply.get("id") == self._last_id:
                if "error" in reply:
                    raise RuntimeError(f"chromium refused {method}: {reply['error']}")
                return reply["result"]

    def wait_for(self, event: str) -> None:
        while True:
            message = self._next_message()
            if message.get("method") == event and message.get("sessionId") == self.session:
                return

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self._write)
        os.close(self._read)


def screenshot_element(url: str, selector: str, path: Path, *, width: int, height: int, pad: int = 8) -> Path:
    """A PNG of the first element `selector` matches (its box plus `pad` pixels around it), once the
    page at `url` has loaded in a `width` x `height` window. ValueError when nothing matches."""
    chromium = require_chromium()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gyre-chromium-") as profile:
        browser = _DevTools(chromium, profile, width, height)
        try:
            browser.call("Page.enable", page=True)
            browser.call("Page.navigate", {"url": url}, page=True)
            browser.wait_for("Page.loadEventFired")
            box = browser.call(
                "Runtime.evaluate",
                {
                    "expression": f"""(() => {{
                        const el = document.querySelector({json.dumps(selector)});
                        if (!el) return null;
                        const r = el.getBoundingClientRect();
                        return {{x: r.left + scrollX, y: r.top + scrollY, width: r.width, height: r.height}};
                    }})()""",
                    "returnByValue": True,
                },
                page=True,
            )["result"].get("value")
            if box is None:
                raise ValueError(f"nothing on {url.split('?')[0]} matches {selector!r}")  # not the key
            clip = {
                "x": max(0.0, box["x"] - pad),
                "y": max(0.0, box["y"] - pad),
                "width": box["width"] + 2 * pad,
                "height": box["height"] + 2 * pad,
                "scale": 1,
            }
            shot = browser.call(
                "Page.captureScreenshot",
                {"format": "png", "clip": clip, "captureBeyondViewport": True},
                page=True,
            )
        finally:
            browser.close()
    path.write_bytes(base64.b64decode(shot["data"]))
    return path
