"""Cluster simulator: the real scheduling policies against a workload and cost model, in virtual time.

Public API: `Workload`, `builtin(name)`, `load_workload_file(path)`, `simulate(workload, policy)`,
`predict(workload, policy) -> dict` (time_per_step_s, device_utilization, max_staleness, ...); the
comparison of every policy lives in `services.scheduler.sim.compare` (`compare`, `compare_seeds`).
"""

from gyre.workload import BUILTIN_WORKLOADS, Workload, builtin, load_workload_file
from services.scheduler.sim.compare import predict, simulate

__all__ = ["BUILTIN_WORKLOADS", "Workload", "builtin", "load_workload_file", "predict", "simulate"]
