"""Sampling of the executions of every training step from a workload (seeded; identical for every policy).
It lives in gyre/workload.py, shared with the rollout's `workload` environment; re-exported here."""

from gyre.workload import ExecutionPlan, sample_executions

__all__ = ["ExecutionPlan", "sample_executions"]
