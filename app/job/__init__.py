"""The main job: run a training job end to end, record its events, and report on it.

Modules (command layer: may reach services by module name, never imported by a service):
- `eventlog`  — the run's event stream as JSON lines (`run_dir/events.jsonl`), one record per event.
- `collector` — subscribes to every `gyre.*` subject of a run and appends to the event log.
- `analysis`  — pure functions from event records to the numbers a report shows.
- `report`    — `report.md` + PNG plots from `events.jsonl` alone (no service internals).
- `plots`     — matplotlib (Agg) figures.
- `progress`  — live progress bars driven by events.
- `run`       — `gyre run CONFIG`; `compare` — `gyre compare RUN...`.
"""
