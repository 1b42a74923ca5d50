"""`Deployment`: a whole Gyre deployment on one machine, as a context manager.

    with Deployment("examples/quickstart.yaml") as d:
        print(d.endpoints.services["trainer"].grpc_address)

Start (each step waits for the previous one):

1. NATS and Postgres: the URLs given here, else the run config / GYRE_NATS_URL / GYRE_DATABASE_URL,
   else embedded servers under `<run_dir>/nats` and `<run_dir>/postgres` on free ports (NATS as a
   local JetStream cluster with `launcher.nats_cluster_size` 3 or 5: app.launcher.servers);
2. the JetStream streams (gyre.bus.subjects, as many replicas as the embedded cluster has nodes) and
   every service's migrations (gyre.store), once, before any service runs;
3. each service as its own process group, in the order scheduler, trajectory, trainer, rollout:
   spawn `python -m services.<name> --config FILE --port 0`, wait for its `GYRE_READY` line, then
   for gRPC health SERVING. Children get GYRE_NATS_URL, GYRE_DATABASE_URL, GYRE_RUN_ID,
   GYRE_RUN_DIR and, for every service started before them, GYRE_<NAME>_ADDRESS plus the override
   of their own config field `<name>_address` if they have one and neither the config nor the
   environment sets it (GYRE_TRAINER__TRAJECTORY_ADDRESS);
4. `<run_dir>/endpoints.json` (mode 0600: it holds the observer's NATS login and the Postgres
   superuser URL).

Credentials (app.launcher.credentials, kept in `<run_dir>/secrets/`): an embedded nats-server
gets one user per service with the subject permissions of gyre.bus.auth (no anonymous access), and
each service's GYRE_NATS_URL carries its own user; an embedded Postgres gets one role per service
(gyre.store.roles), migrations run as that role, and each service's GYRE_DATABASE_URL is its own
role's; every service gets the run's GYRE_GRPC_TOKEN (the config's `grpc_token` if set, else one
generated when NATS is embedded; with external servers only a configured one, so a pod that joins
a cluster agrees with its peers), and this process uses it for its own gRPC calls. The trajectory service is told the
trainer's worker_id and the model's vocabulary unless its section sets them.

A service that exits or times out during start raises DeploymentError with the tail of its log,
after everything started so far has been stopped. Stop runs in reverse order (SIGTERM, grace,
SIGKILL per process group), then the embedded servers; it always runs to the end, and no process
started here outlives it. SIGTERM, where nobody handles it (`gyre run`, `gyre chaos`), stops the
deployment as Ctrl-C does. If this process dies without stopping (SIGKILL, a crash), its guardian
(gyre.embedded.guardian) kills every process it started, those the supervisor thread restarted too.

Supervision (`launcher.restart`, on by default): once started, a supervisor thread polls every
process. A service that exits, for any reason and with any status, except through `stop()` or
`stop_service()`, is started again with the same command, gRPC port and environment plus
GYRE_INCARNATION=<starts so far in this run_dir, <run_dir>/service_starts.json, so a deployment
started again on the same run_dir (`gyre run --resume`) continues the count>, after the backoff of its `RestartPolicy`, and waited for until
SERVING; an embedded nats-server (each node of a cluster on its own, `nats-n<i>`) or Postgres that
exits is started again on the same port with the same data (JetStream file store, Postgres cluster),
so every client's URL stays valid. Each restart
is logged (on_progress) and recorded (`restarts`, `supervision_stats()`); a service that exits more
than `max_restarts` times within `restart_window_s` is given up on (`failed_services()`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Self

import psutil

from app.launcher.config import LauncherConfig, address_overrides, service_config_model
from app.launcher.credentials import RunCredentials
from app.launcher.endpoints import FILENAME, Endpoints, ServiceEndpoint
from app.launcher.healthcheck import check
from app.launcher.process import RestartPolicy, RestartRecord, ServiceProcess
from app.launcher.servers import (
    ensure_streams,
    kind_of,
    new_embedded_nats,
    read_starts,
    run_async,
    stream_replicas,
    supervised_members,
    write_starts,
)
from gyre import rpc
from gyre.bus.auth import ADMIN, OBSERVER
from gyre.config import CommonConfig, load_common, load_section, load_yaml
from gyre.errors import GyreError
from gyre.store import roles


class DeploymentError(GyreError):
    """A service could not be started or died; the message holds the tail of its log."""

    def __init__(self, message: str, service: str | None = None, log_tail: str = "") -> None:
        super().__init__(
            message + (f"\n--- last lines of {service}'s log ---\n{log_tail}" if log_tail else "")
        )
        self.service = service
        self.log_tail = log_tail


def address_env_var(service: str) -> str:
    """Environment variable holding a service's gRPC host:port, e.g. GYRE_SCHEDULER_ADDRESS."""
    return f"GYRE_{service.upper()}_ADDRESS"


class Deployment:
    """Embedded or external NATS + Postgres and every service process of one run.

    Arguments override the run config: `services` (names, any order), `nats_url`/`database_url`
    (external servers), `run_dir`, `extra_env` (added to every service's environment),
    `service_args` (extra command-line arguments per service), `on_progress` (called with one
    human-readable line per start/stop step).
    """

    def __init__(
        self,
        config_path: str | Path | None = None,
        *,
        services: Sequence[str] | None = None,
        run_dir: str | Path | None = None,
        nats_url: str | None = None,
        database_url: str | None = None,
        extra_env: Mapping[str, str] | None = None,
        service_args: Mapping[str, Sequence[str]] | None = None,
        start_timeout_s: float | None = None,
        stop_grace_s: float | None = None,
        host: str | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        self.config_path = Path(config_path).resolve() if config_path is not None else None
        self._raw = load_yaml(self.config_path)
        common = load_common(data=self._raw)
        overrides: dict[str, Any] = {}
        if services is not None:
            overrides["services"] = list(services)
        if start_timeout_s is not None:
            overrides["start_timeout_s"] = start_timeout_s
        if stop_grace_s is not None:
            overrides["stop_grace_s"] = stop_grace_s
        if host is not None:
            overrides["host"] = host
        launcher = load_section(LauncherConfig, "launcher", data=self._raw)
        self.launcher = LauncherConfig.model_validate({**launcher.model_dump(), **overrides})
        self.common: CommonConfig = common
        self.run_dir = Path(run_dir if run_dir is not None else common.run_dir).resolve()
        self._nats_url = nats_url or common.nats_url
        self._database_url = database_url or common.database_url
        self._extra_env = dict(extra_env or {})
        self._service_args = {k: list(v) for k, v in (service_args or {}).items()}
        self._progress = on_progress or (lambda line: None)
        self._embedded: list[Any] = []  # EmbeddedNats / EmbeddedPostgres we started, in start order
        self._credentials: RunCredentials | None = None  # generated secrets (set by start)
        self._previous_token: str | None = None  # this process's gRPC token before start()
        self._procs: list[ServiceProcess] = []
        self._endpoints: Endpoints | None = None
        self._stop_lock = threading.Lock()
        self.restart_policy = RestartPolicy(
            max_restarts=self.launcher.max_restarts,
            window_s=self.launcher.restart_window_s,
            initial_backoff_s=self.launcher.restart_backoff_s,
            max_backoff_s=self.launcher.restart_backoff_max_s,
        )
        self.restarts: list[RestartRecord] = []  # every restart the supervisor did, in order
        self._spawn_env: dict[str, dict[str, str]] = {}  # service -> environment it was started with
        # service -> processes spawned so far in this run_dir, by every deployment that used it (a
        # resumed run continues the count, so a rollout restarted by `gyre run --resume` is incarnation
        # >= 1: it resumes its predecessor's executions and never reuses a group id)
        self._starts: dict[str, int] = read_starts(self.run_dir)
        self._gave_up: dict[str, str] = {}  # service -> why the supervisor stopped restarting it
        self._stopped: set[str] = set()  # services stopped on purpose (stop_service): not restarted
        self._halt = threading.Event()  # set by stop(): the supervisor and any start wait end
        self._supervisor: threading.Thread | None = None
        self._lock = threading.RLock()  # guards _procs / _endpoints between supervisor and callers
        self._sigterm_installed = False  # start() made SIGTERM a graceful stop (_stop_on_sigterm)

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def endpoints(self) -> Endpoints:
        """Where everything is; only after start() returned."""
        if self._endpoints is None:
            raise RuntimeError("Deployment.endpoints is available once start() has returned")
        return self._endpoints

    @property
    def processes(self) -> list[ServiceProcess]:
        """The running service processes, in start order."""
        return list(self._procs)

    def start(self) -> Endpoints:
        """Start everything (see the module docstring); on any failure stop what started and raise."""
        self._stop_on_sigterm()
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Endpoints:
        self._refuse_second_launcher()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        creds = self._credentials = RunCredentials.load_or_create(self.run_dir)
        # A self-contained run (embedded NATS) generates its token; a run that joins external servers
        # (compose, Kubernetes) uses the configured one, or none, as the services it talks to do.
        configured = self.common.grpc_token.get_secret_value() if self.common.grpc_token else None
        token = configured or (creds.grpc_token if self._nats_url is None else None)
        self._previous_token = rpc.default_token()
        rpc.set_default_token(token)  # the job driver and other clients in this process (until stop)
        nats_url = self._nats_url or self._start_embedded_nats()
        database_url = self._database_url or self._start_embedded_postgres()
        secured_nats = self._nats_url is None
        replicas = stream_replicas(self.embedded("nats"))
        self._progress(f"declaring streams on {nats_url}" + (f" ({replicas} replicas)" if replicas else ""))
        run_async(ensure_streams(creds.nats_url(nats_url, ADMIN) if secured_nats else nats_url, replicas))
        self._progress("applying migrations")
        from app.db import upgrade_all

        db_urls: dict[str, str] = {}
        if self._database_url is None:
            db_urls = roles.ensure_service_roles(
                database_url, {s: creds.postgres[s] for s in self.launcher.services}
            )
        upgrade_all(database_url, tuple(self.launcher.services), urls=db_urls)
        env = {
            **os.environ,
            **self._extra_env,
            "GYRE_NATS_URL": nats_url,
            "GYRE_DATABASE_URL": database_url,
            **({"GYRE_GRPC_TOKEN": token} if token else {}),
            "GYRE_RUN_ID": self.common.run_id,
            "GYRE_RUN_DIR": str(self.run_dir),
            "PYTHONUNBUFFERED": "1",
        }
        services: dict[str, ServiceEndpoint] = {}
        for name in self.launcher.services:
            started = {other: ep.grpc_address for other, ep in services.items()}
            section = self._raw.get(name)
            given: dict[str, Any] = section if isinstance(section, dict) else {}
            wiring = {
                key: value
                for key, value in address_overrides(name, started).items()
                if key not in env and not given.get(key.split("__", 1)[1].lower())
            }
            own = {
                **({"GYRE_NATS_URL": creds.nats_url(nats_url, name)} if secured_nats else {}),
                **({"GYRE_DATABASE_URL": db_urls[name]} if name in db_urls else {}),
                **self._trust_wiring(name, env, given),
            }
            self._spawn_env[name] = {**env, **wiring, **own}
            endpoint = self._start_service(name, self._spawn_env[name])
            services[name] = endpoint
            env[address_env_var(name)] = endpoint.grpc_address
        self._endpoints = Endpoints(
            run_id=self.common.run_id,
            run_dir=str(self.run_dir),
            nats_url=creds.nats_url(nats_url, OBSERVER) if secured_nats else nats_url,
            database_url=database_url,
            launcher_pid=os.getpid(),
            services=services,
            embedded=[kind_of(e) for e in self._embedded],
        )
        self._endpoints.write(self.run_dir).chmod(0o600)
        if self.launcher.restart:
            self._supervisor = threading.Thread(target=self._supervise, name="gyre-supervisor", daemon=True)
            self._supervisor.start()
        return self._endpoints

    def _trust_wiring(self, name: str, env: Mapping[str, str], given: Mapping[str, Any]) -> dict[str, str]:
        """What the trajectory service must know to check its inputs: the trainer's worker_id (the
        only consumer allowed to take batches), the model's vocabulary and the run's tokenizer, unless
        set already."""
        if name != "trajectory":
            return {}
        trainer_model = service_config_model("trainer")
        if trainer_model is None:
            return {}
        trainer = load_section(trainer_model, "trainer", data=self._raw)
        worker_id = getattr(trainer, "worker_id", None)
        vocab_size = getattr(getattr(trainer, "model", None), "vocab_size", None)
        tokenizer = getattr(trainer, "tokenizer", None)
        wiring = {
            **({"GYRE_TRAJECTORY__TRAINER_WORKERS": json.dumps([worker_id])} if worker_id else {}),
            **({"GYRE_TRAJECTORY__VOCAB_SIZE": str(vocab_size)} if vocab_size else {}),
            **({"GYRE_TRAJECTORY__TOKENIZER": str(tokenizer)} if tokenizer else {}),
        }
        return {
            key: value
            for key, value in wiring.items()
            if key not in env and given.get(key.split("__", 1)[1].lower()) is None
        }

    def _refuse_second_launcher(self) -> None:
        """Two deployments in one run_dir would share embedded data dirs and logs: refuse the second."""
        path = self.run_dir / FILENAME
        if not path.is_file():
            return
        with contextlib.suppress(GyreError):
            other = Endpoints.read(path).launcher_pid
            if other != os.getpid() and psutil.pid_exists(other):
                raise DeploymentError(
                    f"another deployment (launcher pid {other}) is running with run_dir {self.run_dir}; "
                    "stop it first (Ctrl-C, or kill that pid) or choose another run_dir"
                )
        path.unlink(missing_ok=True)  # left behind by a launcher that was killed

    def _start_embedded_nats(self) -> str:
        size = self.launcher.nats_cluster_size
        self._progress("starting embedded nats-server" + (f" cluster of {size}" if size > 1 else ""))
        assert self._credentials is not None
        server = new_embedded_nats(self.run_dir / "nats", passwords=self._credentials.nats, cluster_size=size)
        self._embedded.append(server)
        return server.start()

    def _start_embedded_postgres(self) -> str:
        from gyre.embedded import EmbeddedPostgres

        self._progress("starting embedded Postgres")
        server = EmbeddedPostgres(self.run_dir / "postgres", database="gyre")
        self._embedded.append(server)
        return server.start()

    def _command(self, name: str) -> list[str]:
        extra = self._service_args.setdefault(name, [])
        if "--port" not in extra:
            # A fixed port: a restarted service is found at the address its peers were given.
            from gyre.embedded import free_port

            extra += ["--port", str(free_port(_connect_host(self.launcher.host).strip("[]")))]
        cmd = [sys.executable, "-m", f"services.{name}", "--host", self.launcher.host]
        if self.config_path is not None:
            cmd += ["--config", str(self.config_path)]
        return cmd + extra

    def _start_service(self, name: str, env: Mapping[str, str]) -> ServiceEndpoint:
        self._progress(f"starting {name}")
        incarnation = self._starts.get(name, 0)
        self._starts[name] = incarnation + 1
        write_starts(self.run_dir, self._starts)
        proc = ServiceProcess(
            name,
            self._command(name),
            {**env, "GYRE_INCARNATION": str(incarnation)},
            self.run_dir / "logs" / f"{name}.log",
        )
        with self._lock:
            old = [i for i, p in enumerate(self._procs) if p.name == name]
            if old:
                self._procs[old[0]] = proc  # a restart keeps the start (and stop) order
            else:
                self._procs.append(proc)
        deadline = time.monotonic() + self.launcher.start_timeout_s
        ready = None
        status = ""
        while time.monotonic() < deadline and not (incarnation and self._halt.is_set()):
            if proc.returncode is not None:
                raise DeploymentError(
                    f"{name} exited with status {proc.returncode} while starting (log: {proc.log_path})",
                    name,
                    proc.log_tail(),
                )
            ready = ready or proc.ready()
            if ready is not None:
                host = _connect_host(self.launcher.host)
                status = check(f"{host}:{ready.grpc_port}", timeout_s=2.0)
                if status == "SERVING":
                    self._progress(f"{name} serving on {host}:{ready.grpc_port}")
                    return ServiceEndpoint(
                        name=name,
                        grpc_address=f"{host}:{ready.grpc_port}",
                        metrics_url=f"http://{host}:{ready.metrics_port}/metrics",
                        pid=proc.pid,
                        log_path=str(proc.log_path),
                    )
            time.sleep(0.1)
        what = "print GYRE_READY" if ready is None else f"report SERVING (last health: {status})"
        raise DeploymentError(
            f"{name} did not {what} within {self.launcher.start_timeout_s:.0f} s (log: {proc.log_path})",
            name,
            proc.log_tail(),
        )

    def dead_services(self) -> list[ServiceProcess]:
        """Services that exited and will not be started again: the supervisor gave up on them (or
        supervision is off). A service being restarted is not dead; one stopped on purpose is not."""
        with self._lock:
            procs = list(self._procs)
        return [
            p
            for p in procs
            if p.returncode is not None
            and p.name not in self._stopped
            and (not self.launcher.restart or p.name in self._gave_up)
        ]

    def failed_services(self) -> dict[str, str]:
        """Service -> why it is down for good (restart budget spent, or exited with supervision off)."""
        failed = dict(self._gave_up)
        for proc in self.dead_services():
            failed.setdefault(proc.name, f"exited with status {proc.returncode} (log: {proc.log_path})")
        return failed

    def check_alive(self) -> None:
        """DeploymentError naming the first service that is down for good, with its log tail."""
        for proc in self.dead_services():
            raise DeploymentError(
                f"{proc.name} {self.failed_services().get(proc.name, 'exited')}", proc.name, proc.log_tail()
            )

    def process(self, name: str) -> ServiceProcess | None:
        """The current process of service `name` (after a restart: the new one)."""
        with self._lock:
            return next((p for p in self._procs if p.name == name), None)

    def embedded(self, kind: str) -> Any:
        """The embedded server `kind` ("nats": an EmbeddedNats or EmbeddedNatsCluster; "postgres")
        this deployment started, else None."""
        return next((e for e in self._embedded if kind_of(e) == kind), None)

    def stop_service(self, name: str) -> int | None:
        """Stop service `name` on purpose (it is not restarted); returns its exit status."""
        self._stopped.add(name)
        proc = self.process(name)
        return None if proc is None else proc.stop(self.launcher.stop_grace_s)

    @property
    def stopped_services(self) -> frozenset[str]:
        """Services stopped on purpose with stop_service()."""
        return frozenset(self._stopped)

    def supervision_stats(self) -> dict[str, Any]:
        """Restart counts per service, every restart with its recovery time, and what was given up."""
        counts: dict[str, int] = {}
        for r in self.restarts:
            counts[r.service] = counts.get(r.service, 0) + 1
        return {
            "restarts": counts,
            "num_restarts": len(self.restarts),
            "gave_up": dict(self._gave_up),
            "restart_events": [{**vars(r), "recovery_s": r.recovery_s} for r in self.restarts],
        }

    # -- supervision --------------------------------------------------------------------------

    def _supervise(self) -> None:
        """Poll every process, restart what exited (module docstring); a failed round is retried."""
        while not self._halt.wait(0.2):
            try:
                self._supervise_once()
            except Exception:
                self._progress(f"supervisor round failed; trying again:\n{traceback.format_exc()}")

    def _supervise_once(self) -> None:
        for name, server in [m for e in list(self._embedded) for m in supervised_members(e)]:
            if server.pid is None and name not in self._gave_up and not self._halt.is_set():
                self._restart_embedded(name, server)
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            if self._halt.is_set():
                return
            if proc.returncode is None or proc.name in self._stopped or proc.name in self._gave_up:
                continue
            self._restart_service(proc)

    def _recent_restarts(self, service: str, now: float) -> int:
        return sum(
            1
            for r in self.restarts
            if r.service == service and r.exited_at > now - self.restart_policy.window_s
        )

    def _begin_restart(self, service: str, exit_code: int | None) -> RestartRecord | None:
        """A RestartRecord after the backoff, or None (budget spent, or stopping meanwhile)."""
        now = time.time()
        recent = self._recent_restarts(service, now)
        if not self.restart_policy.allows(recent):
            self._gave_up[service] = (
                f"exited with status {exit_code}; restart budget spent "
                f"({self.restart_policy.max_restarts} restarts within {self.restart_policy.window_s:.0f} s)"
            )
            self._progress(f"{service}: {self._gave_up[service]}; giving up")
            return None
        backoff = self.restart_policy.backoff_s(recent + 1)
        record = RestartRecord(service=service, exit_code=exit_code, exited_at=now, backoff_s=backoff)
        self.restarts.append(record)
        self._progress(
            f"{service} exited with status {exit_code}; restart {recent + 1}/"
            f"{self.restart_policy.max_restarts} in {backoff:.1f} s"
        )
        if self._halt.wait(backoff):
            return None
        record.restarted_at = time.time()
        return record

    def _restart_service(self, proc: ServiceProcess) -> None:
        code = proc.returncode
        proc.stop(self.launcher.stop_grace_s)  # reap what is left of its process group
        record = self._begin_restart(proc.name, code)
        if record is None:
            return
        try:
            endpoint = self._start_service(proc.name, self._spawn_env[proc.name])
        except DeploymentError as exc:
            record.error = str(exc).splitlines()[0]
            self._progress(f"restart of {proc.name} failed: {record.error}")
            failed = self.process(proc.name)
            if failed is not None:  # e.g. never became SERVING: not left running as a zombie
                failed.stop(self.launcher.stop_grace_s)
            return  # the next poll sees it down again and counts another restart
        record.serving_at = time.time()
        with self._lock:
            if self._endpoints is not None:
                self._endpoints.services[proc.name] = endpoint
                self._endpoints.write(self.run_dir).chmod(0o600)
        self._progress(f"{proc.name} restarted and serving ({record.recovery_s:.1f} s after its exit)")

    def _restart_embedded(self, kind: str, server: Any) -> None:
        record = self._begin_restart(kind, None)
        if record is None:
            return
        try:
            server.restart()
        except GyreError as exc:
            record.error = str(exc)
            self._progress(f"restart of embedded {kind} failed: {exc}")
            return
        record.serving_at = time.time()
        self._progress(f"embedded {kind} restarted on the same port ({record.recovery_s:.1f} s)")

    def _stop_on_sigterm(self) -> None:
        """Where nobody handles SIGTERM (its default kills this process with no cleanup at all, as
        `gyre run` and `gyre chaos` had it), make it a graceful stop: SIGTERM does what Ctrl-C does
        (the current SIGINT handler: asyncio.run's cancels the job's main task, Python's raises
        KeyboardInterrupt), so the `with Deployment(...)` block unwinds through stop(). Main thread
        only (where signal handlers live); the previous handler is back after stop()."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _sigterm_as_sigint)
            self._sigterm_installed = True

    def stop(self) -> None:
        """Stop services in reverse start order, then the embedded servers. Idempotent; never raises
        for a process that is already gone. A SIGTERM that arrives while it runs is ignored when
        start() made SIGTERM a graceful stop (a half-done stop is finished by the guardian anyway:
        gyre.embedded.guardian)."""
        ours = self._sigterm_installed and threading.current_thread() is threading.main_thread()
        if ours:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            self._stop()
        finally:
            if ours:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                self._sigterm_installed = False

    def _stop(self) -> None:
        self._halt.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join()
        with self._stop_lock:
            # Pop only after a stop returned: an interrupted stop() is finished by the next call.
            while self._procs:
                proc = self._procs[-1]
                self._progress(f"stopping {proc.name}")
                proc.stop(self.launcher.stop_grace_s)
                self._procs.pop()
            while self._embedded:
                server = self._embedded[-1]
                self._progress(f"stopping embedded {type(server).__name__.removeprefix('Embedded')}")
                server.stop()
                self._embedded.pop()
            if self._endpoints is not None:
                path = self.run_dir / FILENAME
                if path.is_file() and Endpoints.read(path).launcher_pid == os.getpid():
                    path.unlink()
            if self._credentials is not None:
                rpc.set_default_token(self._previous_token)


def _sigterm_as_sigint(signum: int, frame: FrameType | None) -> None:
    """SIGTERM handled as SIGINT is (Deployment._stop_on_sigterm)."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt(f"{signal.Signals(signum).name}")


def _connect_host(bind_host: str) -> str:
    """Where a client on this machine reaches a server bound to `bind_host`."""
    return "127.0.0.1" if bind_host in {"0.0.0.0", ""} else "[::1]" if bind_host == "::" else bind_host
