"""The analytics tap: read Gyre's event streams as they happen (`gyre events tail`) or from the
start into a table (`gyre events export`). It never acks, creates durable consumers or publishes
(it only declares the streams, idempotently, with the services' own declarations), so tapping a
production run cannot change what the services see.

`device_time.py` measures a finished run's devices as the simulator defines them (s/step over the
simulator's window, busy-based idle, handoffs, migrations, interruptions) for `gyre compare` and
`gyre bench elastic`."""
