"""The workload schema of the simulator. It lives in gyre/workload.py (pure data, shared with the rollout's
`workload` environment and paced devices); this module re-exports it for the simulator's imports."""

from gyre.workload import (
    AGENT_ENV,
    BUILTIN_WORKLOADS,
    MIXED,
    REASONING,
    XLONG,
    Domain,
    LatencyComponent,
    ServiceSemantics,
    Workload,
    builtin,
    load_workload_file,
)

__all__ = [
    "AGENT_ENV",
    "BUILTIN_WORKLOADS",
    "MIXED",
    "REASONING",
    "XLONG",
    "Domain",
    "LatencyComponent",
    "ServiceSemantics",
    "Workload",
    "builtin",
    "load_workload_file",
]
