"""Who may do what on NATS: one user per service, subject permissions derived from gyre.bus.subjects.

Roles (a NATS user each, same name):

* ``scheduler``, ``rollout``, ``trajectory``, ``trainer``: publish only on the streams whose
  ``StreamSpec.producers`` names them (only the scheduler publishes leases, only the trainer weights,
  only the rollout steps and executions, each service only its own metrics and dead letters);
  read (create consumers, fetch, ack) the streams whose ``StreamSpec.consumers`` names them, and
  read back (ephemeral consumers only, like the observer) the streams they produce.
* ``observer``: read-only — ephemeral (ordered) consumers on every Gyre stream, no durable
  consumer, no ack, no publish (the analytics tail, the job's event collector, ``gyre analytics``).
* ``admin``: the JetStream API (declares and updates streams: the launcher, before any service
  starts); it publishes no event.

Every user gets its own reply inbox prefix (``_INBOX_<user>``, which ``Bus.connect`` sets from the
user name), so no user can read another's request replies. JetStream API rights are per stream:
stream info for all; consumer create / info / next and reading a stored message only on the
streams the role reads; no user but
``admin`` can create, update, purge or delete a stream, or delete a consumer.

Known limits (documented in docs/operations.md): a role that reads a stream may create a consumer of
any name on it, so it could re-create another reader's durable of that stream with a different
configuration; keep one service per role.

Credentials travel in the NATS URL (``nats://user:password@host:4222``, the form NATS clients take);
`redact` removes the password before a URL is logged.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from gyre.bus import subjects

SERVICE_ROLES: tuple[str, ...] = ("scheduler", "trajectory", "trainer", "rollout")
OBSERVER = "observer"
ADMIN = "admin"
ROLES: tuple[str, ...] = (*SERVICE_ROLES, OBSERVER, ADMIN)
# A Kubernetes worker pod runs trainer and rollout in one container (deploy/k8s/worker.yaml: a device
# changes role only between processes of one container), where `gyre up` hands both the one URL it
# was given: they log in as this user, with the union of the two services' permissions.
WORKER = "worker"
WORKER_SERVICES: tuple[str, ...] = ("trainer", "rollout")

_JS = "$JS.API"


def inbox_prefix(user: str) -> str:
    """Reply-subject prefix of `user`'s connection (its only subscribe right besides Gyre subjects)."""
    return f"_INBOX_{user}"


@dataclass(frozen=True)
class Permissions:
    """Subjects a NATS user may publish to and subscribe to (NATS wildcards * and >)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def _published_subjects(role: str) -> list[str]:
    out: list[str] = []
    for spec in subjects.STREAMS:
        base = spec.subjects[0].removesuffix(".>")
        for producer in spec.producers:
            name, _, last = producer.partition(":")
            if name != role:
                continue
            # "<service>:<token>": gyre.<kind>.<any run>.<token> only (its own metrics / dead letters).
            out.append(f"{base}.*.{last}" if last else spec.subjects[0])
    return out


def _read_rights(stream: str, *, durable: bool) -> list[str]:
    """JetStream API rights to read `stream`: ephemeral (unnamed, e.g. ordered) consumers and stored
    messages always; with `durable`, also named durable consumers, pulling from them and acking."""
    rights = [
        f"{_JS}.CONSUMER.CREATE.{stream}",  # an unnamed, ephemeral consumer (ordered tails)
        f"{_JS}.CONSUMER.INFO.{stream}.>",
        f"{_JS}.STREAM.MSG.GET.{stream}",  # one stored message (e.g. the last weights event)
        f"{_JS}.DIRECT.GET.{stream}",
        f"{_JS}.DIRECT.GET.{stream}.>",
    ]
    if durable:
        rights += [
            f"{_JS}.CONSUMER.CREATE.{stream}.>",
            f"{_JS}.CONSUMER.DURABLE.CREATE.{stream}.>",
            f"{_JS}.CONSUMER.MSG.NEXT.{stream}.>",
            f"$JS.ACK.{stream}.>",
        ]
    return rights


def permissions(role: str) -> Permissions:
    """The NATS permissions of `role` (one of ROLES, or WORKER); ValueError for an unknown role."""
    if role == WORKER:
        parts = [permissions(service) for service in WORKER_SERVICES]
        union = tuple(dict.fromkeys(p for perms in parts for p in perms.publish))
        return Permissions(publish=union, subscribe=(f"{inbox_prefix(role)}.>", f"{subjects.PREFIX}.>"))
    if role not in ROLES:
        raise ValueError(f"unknown NATS role {role!r}; choose one of {list(ROLES)}")
    subscribe = (f"{inbox_prefix(role)}.>",)
    if role == ADMIN:
        return Permissions(publish=(f"{_JS}.>",), subscribe=subscribe)
    publish = [f"{_JS}.INFO", f"{_JS}.STREAM.INFO.*", f"{_JS}.STREAM.NAMES", "$JS.FC.>"]
    for spec in subjects.STREAMS:
        if role == OBSERVER:
            # Ephemeral (ordered) consumers only: an observer cannot create, redefine or drain a
            # durable consumer, nor ack a message.
            publish += _read_rights(spec.name, durable=False)
        elif role in spec.consumers:
            publish += _read_rights(spec.name, durable=True)
        elif role in {producer.partition(":")[0] for producer in spec.producers}:
            # A producer may read back what is stored (ephemeral consumers only): a restarted
            # rollout replays its executions and steps to resume them (services/rollout/resume.py).
            publish += _read_rights(spec.name, durable=False)
    publish += _published_subjects(role)
    # Core subscriptions to Gyre subjects (a wide tail) see new messages only and change nothing.
    return Permissions(publish=tuple(publish), subscribe=(*subscribe, f"{subjects.PREFIX}.>"))


def generate_password() -> str:
    """A fresh random password (32 url-safe bytes of entropy)."""
    return secrets.token_urlsafe(32)


def password_variable(role: str) -> str:
    """The environment variable holding `role`'s password in deployments (``GYRE_NATS_PASSWORD_<ROLE>``):
    the nats-server config of docker compose and Kubernetes reads it, `server_authorization_from_env`."""
    return f"GYRE_NATS_PASSWORD_{role.upper()}"


def server_authorization(passwords: Mapping[str, str]) -> str:
    """The ``authorization { users = [...] }`` block of a nats-server config for `passwords`
    (role -> password). Roles not in `passwords` cannot connect; anonymous clients are refused."""
    return _authorization({role: json.dumps(password) for role, password in passwords.items()})


def server_authorization_from_env(roles: tuple[str, ...]) -> str:
    """The same block for `roles`, each password a reference to its `password_variable`, which
    nats-server resolves from its environment at start (a missing one stops it): the config can be
    committed, the passwords stay in the deployment's secrets. A password given this way must be a
    plain word (letters and digits, starting with a letter): nats-server parses the variable's value."""
    return _authorization({role: "$" + password_variable(role) for role in roles})


def _authorization(password_values: Mapping[str, str]) -> str:
    users = []
    for role, password in password_values.items():
        perms = permissions(role)
        users.append(
            "    {"
            f"user: {json.dumps(role)}, password: {password}, permissions: {{"
            f"publish: {{allow: {json.dumps(list(perms.publish))}}}, "
            f"subscribe: {{allow: {json.dumps(list(perms.subscribe))}}}"
            "}}"
        )
    return "authorization {\n  users = [\n" + "\n".join(users) + "\n  ]\n}"


def url_with_credentials(url: str, user: str, password: str) -> str:
    """`url` (nats://host:port) with `user:password@` in it (any userinfo already there replaced)."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def user_of(url: str) -> str | None:
    """The user name in a NATS URL, None without one."""
    netloc = urlsplit(url).netloc
    if "@" not in netloc:
        return None
    return unquote(netloc.rsplit("@", 1)[0].split(":", 1)[0]) or None


def redact(url: str) -> str:
    """`url` with its password replaced by ``***`` (safe to log)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, host = parts.netloc.rsplit("@", 1)
    user = userinfo.split(":", 1)[0]
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))
