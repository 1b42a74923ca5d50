"""The run's event log: every event of a run as one JSON line in `run_dir/events.jsonl`.

A record is `{"type": "StepEvent", "subject": "gyre.steps.r.t0", "recv_unix_s": 1.7e9, "event": {...}}`
where `event` is the protobuf message as JSON (`MessageToDict`, proto field names, enums by name,
int64 values as strings — readers coerce with `int()`/`float()`).

Step events are summarised before they are written, so the log stays small for long rollouts:
token ids and log-probs are replaced by their counts, and the per-token policy versions by a
histogram `completion_version_counts: {"<version>": num_tokens}`. Nothing else is dropped.

Guarantees: records are appended and flushed one line at a time, so a crashed run leaves a
readable log (a truncated last line is skipped by `read_events`). Events with an `event_id`
already in the log are skipped (JetStream may redeliver): a writer opened on an existing log (a
resumed run, `gyre run --resume`) first reads the keys it holds and cuts a torn last line, so the
log of a run that was stopped and resumed is one log of the whole run, each event once.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from google.protobuf import json_format
from google.protobuf.message import Message

EVENT_LOG_NAME = "events.jsonl"


def summarise_step(step_dict: dict[str, Any]) -> dict[str, Any]:
    """Replace a StepEvent dict's token arrays by counts and a version histogram (in place, returned)."""
    prompt = step_dict.pop("prompt_token_ids", [])
    completion = step_dict.pop("completion_token_ids", [])
    step_dict.pop("completion_logprobs", None)
    versions = step_dict.pop("completion_versions", [])
    # a compact prompt (prompt_base_call_seq set) is `prompt_base_len` tokens of an earlier call + these
    base = int(step_dict.get("prompt_base_len", 0)) if "prompt_base_call_seq" in step_dict else 0
    step_dict["num_prompt_tokens"] = base + len(prompt)
    step_dict["num_completion_tokens"] = len(completion)
    step_dict["completion_version_counts"] = {
        str(v): n for v, n in sorted(Counter(int(x) for x in versions).items())
    }
    return step_dict


def to_record(msg: Message, subject: str = "", recv_unix_s: float | None = None) -> dict[str, Any]:
    """One event log record for a decoded event message."""
    data = json_format.MessageToDict(msg, preserving_proto_field_name=True)
    type_name = msg.DESCRIPTOR.name
    if type_name == "StepEvent":
        summarise_step(data)
    return {
        "type": type_name,
        "subject": subject,
        "recv_unix_s": time.time() if recv_unix_s is None else recv_unix_s,
        "event": data,
    }


def _key(record: dict[str, Any]) -> str:
    """What makes a record a duplicate of another: its type and event_id."""
    return f"{record.get('type')}:{record.get('event', {}).get('event_id', '')}"


def _cut_torn_tail(path: Path) -> None:
    """Drop a last line that a killed writer left without its newline (appending would glue to it)."""
    with path.open("rb+") as fh:
        size = fh.seek(0, 2)
        if size == 0:
            return
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return
        end = size
        while end > 0:  # back to the last newline, a chunk at a time
            start = max(0, end - (1 << 20))
            fh.seek(start)
            cut = fh.read(end - start).rfind(b"\n")
            if cut >= 0:
                fh.truncate(start + cut + 1)
                return
            end = start
        fh.truncate(0)


class EventLogWriter:
    """Appends records to a JSON-lines file; skips an `event_id` it has already written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._seen: set[str] = set()
        if path.is_file():
            _cut_torn_tail(path)
            self._seen = {_key(r) for r in iter_events(path) if r["event"].get("event_id")}
        self._file: TextIO = path.open("a", encoding="utf-8")
        self.num_written = 0
        self.num_duplicates = 0

    def write(self, record: dict[str, Any]) -> bool:
        """Append one record; return False (and write nothing) for an event_id seen before."""
        event_id = str(record.get("event", {}).get("event_id", ""))
        key = _key(record)
        if event_id and key in self._seen:
            self.num_duplicates += 1
            return False
        if event_id:
            self._seen.add(key)
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        self.num_written += 1
        return True

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> EventLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_events(path: Path) -> Iterator[dict[str, Any]]:
    """Records of an event log in file order; a malformed line (e.g. a torn last write) is skipped."""
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "type" in record and isinstance(record.get("event"), dict):
                yield record


def read_events(path: Path) -> list[dict[str, Any]]:
    """All records of an event log (see `iter_events`)."""
    return list(iter_events(path))
