"""The `gyre` command.

Each sub-command lives in its own module, imported only when that command runs, so `gyre --help`
stays fast and a service's heavy imports (torch, Megatron) load only when needed. A module named
here exposes `main(argv: list[str]) -> int` and parses its own arguments.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, one-line help). Nested commands use "group sub" keys.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": (
        "app.launcher.cli",
        "start NATS, Postgres and every service; --check verifies health and stops",
    ),
    "status": ("app.launcher.status", "show the health of every service of a running deployment"),
    "events": ("app.analytics.cli", "events tail [SUBJECT] | events export --format parquet"),
    "db": ("gyre.store.cli", "db upgrade: apply every service's Alembic migrations"),
    "run": (
        "app.job.run",
        "run a training job from a YAML config (the quickstart: examples/quickstart.yaml)",
    ),
    "ui": ("app.ui.server", "ui RUN_DIR: read-only web dashboard (curves, device lanes, executions, trees)"),
    "chaos": (
        "app.chaos",
        "run a job while killing each service, NATS and Postgres in turn; print recovery and loss counters",
    ),
    "compare": (
        "app.job.compare",
        "compare run directories side by side, with the simulator's prediction",
    ),
    "sim": ("services.scheduler.sim.cli", "discrete-event cluster simulator of the scheduling policies"),
    "trajectory": (
        "services.trajectory.cli",
        "trajectory export --execution ID: rebuild every call of an execution",
    ),
    "bench trajectory": (
        "services.trajectory.bench",
        "tree vs flat vs interleaved tokens, ingest and reconstruct speed",
    ),
    "bench rollout": (
        "services.rollout.bench",
        "executions across devices reassigned under load, live migration",
    ),
    "bench trainer": ("services.trainer.bench", "tree-packed vs flat training step"),
    "plan trainer": (
        "app.cli.plan_trainer",
        "memory plan of a trainer replica: params, optimizer, activations, loss",
    ),
    "bench elastic": (
        "app.cli.bench_elastic",
        "colocate, async and elastic on paced devices, each next to the simulator's prediction",
    ),
    "fuzz": (
        "app.fuzz",
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
    module = importlib.import_module(COMMANDS[key][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
