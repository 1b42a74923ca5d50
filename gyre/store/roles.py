"""One Postgres role per service, owning only its own tables.

``ensure_service_roles(admin_url, passwords)`` creates (or re-passwords) a LOGIN role
``gyre_<service>`` for each service, lets it connect to the database, and lets the services that
have migrations create tables in schema ``public``. A service's migrations then run *as its role*
(``app.db.upgrade_all(urls=...)``), so its tables and its ``alembic_version_<service>``
belong to it; Postgres grants no other role anything on them (no superuser, no shared role), so
the rollout cannot read the trajectory's tables nor the scheduler write them.

For an external Postgres an operator runs the same statements (docs/operations.md#security shows
them) or calls this function once with an administrator's URL.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import quote

import sqlalchemy as sa

from gyre.errors import ConfigError, Unavailable

ROLE_PREFIX = "gyre_"


def service_role(service: str) -> str:
    """The Postgres role of `service` (``gyre_<service>``)."""
    if not service.isidentifier():
        raise ConfigError(f"service name {service!r} cannot name a Postgres role")
    return f"{ROLE_PREFIX}{service}"


def _psycopg_conninfo(url: str) -> str:
    return sa.engine.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def ensure_service_roles(
    admin_url: str,
    passwords: Mapping[str, str],
    *,
    creates_tables: tuple[str, ...] = ("scheduler", "trajectory"),
) -> dict[str, str]:
    """Create or update the role of each service in `passwords` (service -> password) on the
    database of `admin_url` (a role that may create roles); returns service -> its own URL.
    Idempotent: a second call changes only passwords."""
    import psycopg
    from psycopg import sql

    target = sa.engine.make_url(admin_url)
    database = target.database or "postgres"
    try:
        with psycopg.connect(_psycopg_conninfo(admin_url), autocommit=True) as conn:
            for service, password in passwords.items():
                role = sql.Identifier(service_role(service))
                exists = conn.execute(
                    "SELECT 1 FROM pg_roles WHERE rolname = %s", (service_role(service),)
                ).fetchone()
                verb = "ALTER" if exists else "CREATE"
                conn.execute(
                    sql.SQL(verb + " ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD {}").format(
                        role, sql.Literal(password)
                    )
                )
                conn.execute(
                    sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(sql.Identifier(database), role)
                )
                if service in creates_tables:
                    conn.execute(sql.SQL("GRANT USAGE, CREATE ON SCHEMA public TO {}").format(role))
                else:
                    conn.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(role))
    except psycopg.OperationalError as exc:
        raise Unavailable(
            f"cannot create the service roles on {target.render_as_string(hide_password=True)}: {exc}"
        ) from exc
    return {service: role_url(admin_url, service, password) for service, password in passwords.items()}


def role_url(url: str, service: str, password: str) -> str:
    """`url` with the credentials of `service`'s role instead of its own."""
    parts = sa.engine.make_url(url)
    host = parts.host or "127.0.0.1"
    port = f":{parts.port}" if parts.port else ""
    user = quote(service_role(service), safe="")
    return f"{parts.drivername}://{user}:{quote(password, safe='')}@{host}{port}/{parts.database or ''}"
