"""One log format for every Gyre process: UTC timestamp, level, service, logger, message (stderr)."""

from __future__ import annotations

import logging
import sys
import time

_FORMAT = "%(asctime)s.%(msecs)03dZ %(levelname)-7s {service} %(name)s: %(message)s"


def setup(service: str, level: str = "INFO") -> None:
    """Configure the root logger for `service` (replaces earlier handlers; safe to call again)."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = logging.Formatter(_FORMAT.format(service=service), datefmt="%Y-%m-%dT%H:%M:%S")
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Chatty libraries: their INFO lines are noise next to ours.
    for noisy in ("alembic.runtime.migration", "nats", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
