"""The `gyre` command.

Each sub-command lives in its own module, imported only when that command runs, so `gyre --help`
stays fast and a service's heavy imports (torch, Megatron) load only when needed. A module named
here exposes `main(argv: list[str]) -> int` and parses its own arguments.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

# command -> (loader, one-line help). Nested commands use "group sub" keys. Each loader imports its
# command's module with an import statement inside a function: nothing heavy loads until that command
# runs, and the layer contract (pyproject.toml, `lint-imports`) sees every edge from here.
Main = Callable[[list[str]], "int | None"]


def _up() -> Main:
    from app.launcher import cli

    return cli.main


def _status() -> Main:
    from app.launcher import status

    return status.main


def _events() -> Main:
    from app.analytics import cli

    return cli.main


def _db() -> Main:
    from app import db

    return db.main


def _run() -> Main:
    from app.job import run

    return run.main


def _ui() -> Main:
    from app.ui import server

    return server.main


def _chaos() -> Main:
    from app import chaos

    return chaos.main


def _compare() -> Main:
    from app.job import compare

    return compare.main


def _sim() -> Main:
    from services.scheduler.sim import cli

    return cli.main


def _trajectory() -> Main:
    from services.trajectory import cli

    return cli.main


def _bench_trajectory() -> Main:
    from services.trajectory import bench

    return bench.main


def _bench_rollout() -> Main:
    from services.rollout import bench

    return bench.main


def _bench_trainer() -> Main:
    from services.trainer import bench

    return bench.main


def _plan_trainer() -> Main:
    from app.cli import plan_trainer

    return plan_trainer.main


def _bench_elastic() -> Main:
    from app.cli import bench_elastic

    return bench_elastic.main


def _bench_xlong() -> Main:
    from app.bench import xlong

    return xlong.main


def _fuzz() -> Main:
    from app import fuzz

    return fuzz.main


COMMANDS: dict[str, tuple[Callable[[], Main], str]] = {
    "up": (_up, "start NATS, Postgres and every service; --check verifies health and stops"),
    "status": (_status, "show the health of every service of a running deployment"),
    "events": (_events, "events tail [SUBJECT] | events export --format parquet"),
    "db": (_db, "db upgrade: apply every service's Alembic migrations"),
    "run": (_run, "run a training job from a YAML config (the quickstart: examples/quickstart.yaml)"),
    "ui": (_ui, "ui RUN_DIR: read-only web dashboard (curves, device lanes, executions, trees)"),
    "chaos": (
        _chaos,
        "run a job while killing each service, NATS and Postgres in turn; print recovery and loss counters",
    ),
    "compare": (_compare, "compare run directories side by side, with the simulator's prediction"),
    "sim": (_sim, "discrete-event cluster simulator of the scheduling policies"),
    "trajectory": (_trajectory, "trajectory export --execution ID: rebuild every call of an execution"),
    "bench trajectory": (
        _bench_trajectory,
        "tree vs flat vs interleaved tokens, ingest and reconstruct speed",
    ),
    "bench rollout": (_bench_rollout, "executions across devices reassigned under load, live migration"),
    "bench trainer": (_bench_trainer, "tree-packed vs flat training step"),
    "plan trainer": (_plan_trainer, "memory plan of a trainer replica: params, optimizer, activations, loss"),
    "bench elastic": (
        _bench_elastic,
        "colocate, async and elastic on paced devices, each next to the simulator's prediction",
    ),
    "bench xlong": (
        _bench_xlong,
        "100K-1M-token executions through NATS, ingest, trees, packing and the trainer's pull, per point",
    ),
    "fuzz": (
        _fuzz,
        "hypothesis inputs against the HTTP endpoint and event consumers (real servers); counts crashes",
    ),
}


def _usage() -> str:
    lines = ["usage: gyre COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<18} {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "Run `gyre COMMAND --help` for the arguments of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the module of the command named in argv; return its exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] in {"-V", "--version"}:
        from gyre import __version__

        print(f"gyre {__version__}")
        return 0
    key, rest = args[0], args[1:]
    if len(args) >= 2 and f"{args[0]} {args[1]}" in COMMANDS:
        key, rest = f"{args[0]} {args[1]}", args[2:]
    if key not in COMMANDS:
        groups = sorted({k.split()[1] for k in COMMANDS if k.startswith(args[0] + " ")})
        hint = f"; `gyre {args[0]}` needs one of: {', '.join(groups)}" if groups else ""
        print(f"gyre: unknown command {' '.join(args[:2])!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    command_main = COMMANDS[key][0]()
    return int(command_main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
