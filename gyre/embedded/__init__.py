"""Embedded nats-server and Postgres for runs and tests that set no external URL.

Both run as child processes on free ports of 127.0.0.1 with their data under `data_dir`, and are
context managers: ``with EmbeddedNats(run_dir / "nats") as n: n.url``. ``stop()`` shuts the server
down gracefully, kills it after a grace period, and never leaves a process behind; it also runs at
interpreter exit. Each server runs through the one process runner of Gyre
(`gyre.embedded.process.ProcessGroup`, which the launcher's supervised services use too): its own
session (so a Ctrl-C to the launcher's terminal does not reach it before the services drained), and
is watched by the parent's guardian (gyre.embedded.guardian), so a SIGKILLed parent does not orphan
it, whichever thread started it.

Modules: `process` (the process-group runner), `guardian` (the reaper of a dead parent's
children), `server` (the base of both servers, free ports), `nats` (EmbeddedNats), `postgres`
(EmbeddedPostgres).
"""

from gyre.embedded.nats import NATS_MAX_PAYLOAD, EmbeddedNats, nats_server_binary
from gyre.embedded.postgres import POSTGRES_OS_USER, EmbeddedPostgres, postgres_bin_dir
from gyre.embedded.process import ProcessGroup
from gyre.embedded.server import EmbeddedServer, free_port

__all__ = [
    "NATS_MAX_PAYLOAD",
    "POSTGRES_OS_USER",
    "EmbeddedNats",
    "EmbeddedPostgres",
    "EmbeddedServer",
    "ProcessGroup",
    "free_port",
    "nats_server_binary",
    "postgres_bin_dir",
]
