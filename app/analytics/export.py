"""Events -> a table (pyarrow): one row per event, columns from app.analytics.flatten.

Columns are the union over all events; a column an event type does not have is null in its rows.
A column whose values mix types across event types (rare) is stored as text.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from app.analytics.tap import EventRecord

FORMATS = ("parquet", "csv", "jsonl")


def to_table(records: Sequence[EventRecord]) -> pa.Table:
    """One row per record; `time` as a UTC timestamp column, ordered by (time, stream, seq)."""
    ordered = sorted(records, key=lambda r: (r.time, r.stream, r.seq))
    rows: list[dict[str, object]] = [{**r.row(), "time": r.time} for r in ordered]
    columns: dict[str, list[object]] = {}
    for i, row in enumerate(rows):
        for key, value in row.items():
            columns.setdefault(key, [None] * i).append(value)
        for values in columns.values():
            if len(values) < i + 1:
                values.append(None)
    arrays = {}
    for key, values in columns.items():
        try:
            arrays[key] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            arrays[key] = pa.array([None if v is None else str(v) for v in values], type=pa.string())
    if not arrays:
        return pa.table(
            {"subject": pa.array([], pa.string()), "time": pa.array([], pa.timestamp("us", "UTC"))}
        )
    return pa.table(arrays)


def write(table: pa.Table, out: Path, fmt: str) -> Path:
    """Write `table` to `out` as parquet, csv or jsonl; creates the parent directory."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        pq.write_table(table, out)
    elif fmt == "csv":
        pa_csv.write_csv(table, out)
    else:
        import json

        with out.open("w") as f:
            for row in table.to_pylist():
                f.write(json.dumps(row, default=str) + "\n")
    return out
