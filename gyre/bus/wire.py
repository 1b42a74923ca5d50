"""What every Gyre message carries on the wire and the counters of the bus: message-id headers
(the identity rules of gyre/bus/nats_bus.py's docstring), dead-letter headers, header-safe
text, the stream-config comparison of ensure_streams, and rate-limited logging.
"""

from __future__ import annotations

import hashlib
import logging
import time

from nats.js import api
from prometheus_client import Counter

from gyre.bus import subjects
from gyre.errors import InvalidArgument

log = logging.getLogger("gyre.bus")

MSG_ID_HEADER = "Nats-Msg-Id"
# The event's own id, `<subject>/<msg_id>`, without the payload digest (duplicate detection).
EVENT_ID_HEADER = "Gyre-Msg-Id"
DEAD_REASON_HEADER = "Gyre-Dead-Reason"
DEAD_SUBJECT_HEADER = "Gyre-Dead-Subject"
DEAD_CODE_HEADER = "Gyre-Dead-Code"
# Bytes of "NATS/1.0\r\n" + the final "\r\n" of a header block; each header adds ": " and "\r\n".
HEADER_BLOCK_OVERHEAD = len("NATS/1.0\r\n") + len("\r\n")
# Event ids a consumer remembers to spot a second, different payload under the same id.
SEEN_IDS = 65_536

PUBLISHED = Counter("gyre_bus_published_total", "Messages stored by JetStream", ["stream"])
PUBLISH_RETRIES = Counter(
    "gyre_bus_publish_retries_total",
    "Publishes repeated (same msg_id) because JetStream did not answer, e.g. during a leader election",
)
PUBLISH_DUPLICATES = Counter(
    "gyre_bus_publish_duplicates_total",
    "Publishes dropped by the stream as duplicates of a msg_id (same event id and same payload)",
    ["stream"],
)
CONSUMED = Counter(
    "gyre_bus_consumed_total",
    "Messages a durable consumer finished, by outcome (ack, nak = redelivered later, term = undecodable)",
    ["consumer", "outcome"],
)
CONFLICTING_IDS = Counter(
    "gyre_bus_conflicting_ids_total",
    "Messages whose event id a consumer had already seen with a different payload (both were delivered)",
    ["consumer"],
)
DEAD_LETTERS = Counter(
    "gyre_dead_letters_total",
    "Messages refused as invalid and sent to GYRE_DEAD_LETTERS",
    ["service", "code"],
)
DEAD_LETTERS_LOST = Counter(
    "gyre_dead_letters_lost_total", "Dead letters that could not be stored (the refusal stands)", ["service"]
)


def message_id_headers(subject: str, msg_id: str, data: bytes) -> dict[str, str]:
    """Headers of a message with event id `msg_id`: ``Nats-Msg-Id`` is
    ``<subject>/<msg_id>/<blake2b-96 of the payload>``, so JetStream drops only a repeat of the *same*
    event (a retry), and a message published first under a guessed id with another payload cannot
    make the stream drop the real one; ``Gyre-Msg-Id`` (``<subject>/<msg_id>``) lets consumers see
    and count two different payloads under one id."""
    event_key = f"{subject}/{msg_id}"
    digest = hashlib.blake2b(data, digest_size=12).hexdigest()
    return {MSG_ID_HEADER: f"{event_key}/{digest}", EVENT_ID_HEADER: event_key}


def headers_size(headers: dict[str, str]) -> int:
    return HEADER_BLOCK_OVERHEAD + sum(len(k) + len(v) + 4 for k, v in headers.items())


def one_line(text: str, limit: int) -> str:
    """A header-safe value: printable ASCII on one line, at most `limit` characters."""
    flat = "".join(ch if 32 <= ord(ch) < 127 else "?" for ch in text)
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def same_stream_config(have: api.StreamConfig, want: api.StreamConfig) -> bool:
    """True when the server's stream config matches ours in everything ensure_streams sets."""

    def close(a: float | None, b: float | None) -> bool:
        return abs((a or 0.0) - (b or 0.0)) < 1e-3

    return (
        sorted(have.subjects or []) == sorted(want.subjects or [])
        and (have.description or "") == (want.description or "")
        and have.retention == want.retention
        and have.storage == want.storage
        and have.discard == want.discard
        and (have.max_bytes if have.max_bytes is not None else -1) == want.max_bytes
        and close(have.max_age, want.max_age)
        and close(have.duplicate_window, want.duplicate_window)
        and (have.num_replicas or 1) == (want.num_replicas or 1)
    )


class RateLimitedLog:
    """Logs at most `per_window` lines per key and window of `window_s` seconds; the first line of
    the next window says how many were suppressed (a flood of bad messages is a few lines a minute)."""

    def __init__(self, logger: logging.Logger, per_window: int = 5, window_s: float = 60.0) -> None:
        self._log = logger
        self._per_window = per_window
        self._window_s = window_s
        self._state: dict[str, tuple[float, int, int]] = {}  # key -> (window start, logged, suppressed)

    def log(self, key: str, fmt: str, *args: object) -> bool:
        """Log a WARNING unless `key` used up its lines this window; True if it was logged."""
        now = time.monotonic()
        start, logged, suppressed = self._state.get(key, (now, 0, 0))
        if now - start >= self._window_s:
            if suppressed:
                self._log.warning(
                    "%d more %r lines suppressed in the last %.0f s", suppressed, key, now - start
                )
            start, logged, suppressed = now, 0, 0
        if logged >= self._per_window:
            self._state[key] = (start, logged, suppressed + 1)
            return False
        self._state[key] = (start, logged + 1, suppressed)
        self._log.warning(fmt, *args)
        return True


DEAD_LOG = RateLimitedLog(log)
CONFLICT_LOG = RateLimitedLog(log)
DENIED_LOG = RateLimitedLog(log)


def stream_label(subject: str) -> str:
    try:
        return subjects.stream_for(subject).name
    except InvalidArgument:
        return "other"
