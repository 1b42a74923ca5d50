"""Typed configuration: one pydantic model per service plus the run's common settings.

A run is one YAML file. Top-level keys are `CommonConfig` fields; each service reads its own
section (`scheduler:`, `rollout:`, `trajectory:`, `trainer:`), validated by that service's config
class. Environment variables override the file: `GYRE_<FIELD>` for common fields (e.g.
`GYRE_NATS_URL`, `GYRE_DATABASE_URL`) and `GYRE_<SECTION>__<FIELD>` for a section field at any depth, `__` between
levels (e.g. `GYRE_TRAINER__LR=1e-4`, `GYRE_TRAINER__MODEL__VOCAB_SIZE=1024`); a nested override
merges into the file's mapping instead of replacing it. A bad value fails at load with the field, the value and a hint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from gyre.errors import ConfigError
from gyre.pacing import DevicesConfig

M = TypeVar("M", bound="ConfigModel")


class ConfigModel(BaseModel):
    """Base of every config: unknown keys are errors (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class CommonConfig(ConfigModel):
    """Settings every service of a run shares."""

    run_id: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Name of the run; a NATS subject token, so only letters, digits, '_' and '-'.",
    )
    run_dir: Path = Field(
        Path("runs/default"),
        description="Directory for this run's logs, embedded servers' data, weights, checkpoints and report.",
    )
    nats_url: str | None = Field(
        None,
        description=(
            "NATS server URL; with authentication, this service's own user in it (nats://<service>:<password>@host:4222, "
            "users and subject permissions in docs/operations.md#security). Unset: the launcher starts an embedded "
            "nats-server with one generated user per service."
        ),
    )
    database_url: str | None = Field(
        None,
        description=(
            "SQLAlchemy URL of Postgres as this service's own role (postgresql+psycopg://gyre_<service>:<password>@host/db). "
            "Unset: embedded Postgres with a generated password and one role per service."
        ),
    )
    grpc_token: SecretStr | None = Field(
        None,
        description=(
            "Shared bearer token every gRPC call of the run must carry (health checks excepted); every service and "
            "client of the run uses the same one. Unset: gRPC is open (tests, local development); `gyre up` "
            "generates one (GYRE_GRPC_TOKEN) unless set."
        ),
    )
    seed: int = Field(0, ge=0, description="Seed of every random generator in the run.")
    log_level: str = Field("INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$", description="Python log level.")
    devices: DevicesConfig = Field(
        default_factory=lambda: DevicesConfig.model_validate({}),
        description="The pool's devices as every worker sees them: paced devices (gyre/pacing.py).",
    )


def _env_overrides(section: str | None) -> dict[str, Any]:
    """The GYRE_* environment as a nested mapping: `GYRE_<SECTION>__<A>__<B>=v` becomes
    `{"a": {"b": v}}` for that section (any depth; `__` separates levels), `GYRE_<FIELD>=v` a
    common field. Values are parsed as YAML scalars or flow collections (`[1, 2]`, `{a: 1}`)."""
    prefix = "GYRE_" if section is None else f"GYRE_{section.upper()}__"
    out: dict[str, Any] = {}
    for key, value in sorted(os.environ.items()):
        if not key.startswith(prefix):
            continue
        path = key[len(prefix) :].lower().split("__")
        if section is None and len(path) > 1:
            continue
        if any(not part for part in path):
            raise ConfigError(
                f"environment variable {key}: empty level in its name (use one '__' between levels)"
            )
        node = out
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[path[-1]] = yaml.safe_load(value) if value else value
    return out


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` with `override` laid over it: mappings merge key by key at every depth, any other
    value (a list, a scalar) replaces the one below. Neither input is modified."""
    merged = dict(base)
    for key, value in override.items():
        below = merged.get(key)
        merged[key] = (
            deep_merge(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
        )
    return merged


def load_yaml(path: str | Path | None) -> dict[str, Any]:
    """Read a YAML mapping; a missing file or a non-mapping is a ConfigError."""
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist; pass an existing YAML file (see examples/)")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a YAML mapping at top level, got {type(data).__name__}")
    return data


def build(cls: type[M], data: dict[str, Any], *, where: str) -> M:
    """Validate `data` as `cls`; turn pydantic's error into one readable ConfigError."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(root)"
            field = cls.model_fields.get(str(err["loc"][0])) if err["loc"] else None
            hint = f" — {field.description}" if field is not None and field.description else ""
            lines.append(f"  {where}.{loc}: {err['msg']} (got {err.get('input')!r}){hint}")
        raise ConfigError(f"invalid configuration in {where}:\n" + "\n".join(lines)) from None


def load_common(path: str | Path | None = None, data: dict[str, Any] | None = None) -> CommonConfig:
    """CommonConfig from the YAML file's top-level keys (service sections ignored) plus GYRE_* env."""
    raw = dict(data if data is not None else load_yaml(path))
    fields = {k: v for k, v in raw.items() if k in CommonConfig.model_fields}
    fields.update({k: v for k, v in _env_overrides(None).items() if k in CommonConfig.model_fields})
    return build(CommonConfig, fields, where="run")


def load_section(
    cls: type[M], section: str, path: str | Path | None = None, data: dict[str, Any] | None = None
) -> M:
    """A service's config from the `section:` mapping of the run YAML plus GYRE_<SECTION>__* env."""
    raw = dict(data if data is not None else load_yaml(path))
    sec = raw.get(section) or {}
    if not isinstance(sec, dict):
        raise ConfigError(f"section {section!r} must be a mapping, got {type(sec).__name__}")
    merged = deep_merge(sec, _env_overrides(section))
    return build(cls, merged, where=section)
