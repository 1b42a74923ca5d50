"""Read the history of an offline W&B run back from its transaction log (`offline-run-*/run-*.wandb`).

W&B has no public reader for the log its offline mode writes, so this is one: the file is a
7-byte header (`:W&B`, magic 0xBEE1, version 0) and then 32 KiB blocks of records, each record
a 7-byte header (CRC-32C: 4 bytes, length: 2 bytes little-endian, type: 1 byte; FULL=1, FIRST=2,
MIDDLE=3, LAST=4 for a payload split across blocks) and its payload, a serialised
`wandb_internal_pb2.Record`. `history_rows` returns every `run.log` row in the order logged.
The checksum is not verified: the reader is for tests and inspection, not recovery.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

BLOCK_BYTES = 32 * 1024
HEADER = b":W&B"
RECORD_HEADER_BYTES = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(path: Path) -> list[bytes]:
    """Every record payload of a .wandb file, reassembled across blocks. ValueError if not one."""
    data = path.read_bytes()
    if not data.startswith(HEADER):
        raise ValueError(f"{path} is not a W&B transaction log (no {HEADER!r} header)")
    out: list[bytes] = []
    pos, parts = 7, b""
    while pos + RECORD_HEADER_BYTES <= len(data):
        left_in_block = BLOCK_BYTES - pos % BLOCK_BYTES
        if left_in_block < RECORD_HEADER_BYTES:  # block trailer: padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        pos += RECORD_HEADER_BYTES
        chunk = data[pos : pos + length]
        pos += length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            parts = chunk
        elif kind == MIDDLE:
            parts += chunk
        elif kind == LAST:
            out.append(parts + chunk)
            parts = b""
        elif kind == 0 and length == 0:  # zero padding at the end of a block
            pos += BLOCK_BYTES - pos % BLOCK_BYTES if pos % BLOCK_BYTES else 0
        else:
            raise ValueError(
                f"{path}: unknown record type {kind} at byte {pos - length - RECORD_HEADER_BYTES}"
            )
    return out


def history_rows(path: Path) -> list[dict[str, Any]]:
    """Every row logged with `run.log`, as {key: value} (W&B's own `_step` etc. included)."""
    from wandb.proto import wandb_internal_pb2

    rows: list[dict[str, Any]] = []
    for payload in payloads(path):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def offline_run_log(wandb_dir: Path) -> Path:
    """The transaction log of the (single, newest) offline run under a sink's W&B directory."""
    found = sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    if not found:
        raise FileNotFoundError(f"no offline W&B run under {wandb_dir}")
    return found[-1]


def record_types(path: Path) -> list[str]:
    """The record type of every record of a .wandb file, in order (e.g. "run", "history", "exit")."""
    from wandb.proto import wandb_internal_pb2

    out = []
    for payload in payloads(path):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        record.ParseFromString(payload)
        out.append(str(record.WhichOneof("record_type")))
    return out


def complete_run_log(wandb_dir: Path, *, timeout_s: float = 60.0) -> Path:
    """`offline_run_log(wandb_dir)` once it holds its `exit` record: W&B's service process writes the
    log behind the client, so a log read right after `finish()` on a loaded machine can still lack
    its last records. TimeoutError if the exit record does not come within `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            path = offline_run_log(wandb_dir)
            if "exit" in record_types(path):
                return path
        except (FileNotFoundError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the offline W&B run under {wandb_dir} has no exit record after {timeout_s:.0f} s"
            )
        time.sleep(0.2)
