"""The pipeline rules the live services and the cluster simulator share, as one code path each.

- Admission under a staleness bound (the rollout's `ExecutionManager`, the simulator's batch
  admission, the policies' `may_start_batch`): with G groups per weight version and bound S, at most
  G * (latest_version + 1 + S) groups are started in total. Batch k (the groups step k trains) may
  therefore start under version v iff k - v <= S; bound 0 is synchronous.
- When a group is scored (the trajectory service's `GroupScoring.ready`, the simulator's scoring):
  when every member has ended, or `train_unfinished_after_s` after its first member ended
  (partial-progress scoring; the members still running are scored on their progress so far).

Pure functions: no clock, no I/O. Times are seconds on one clock (unix seconds live, virtual
seconds in the simulator); the rules only ever compare two of them.
"""

from __future__ import annotations


def groups_allowed(groups_per_version: int, latest_version: int, staleness_bound: int) -> int | None:
    """Groups that may have been started in total once `latest_version` is published; None when
    admission is unbounded (`groups_per_version` <= 0)."""
    if groups_per_version <= 0:
        return None
    return groups_per_version * (latest_version + 1 + max(0, staleness_bound))


def may_start_batch(batch_index: int, latest_version: int, staleness_bound: int) -> bool:
    """Whether batch `batch_index` (trained by step `batch_index`, which publishes version
    `batch_index + 1`) may start generating under `latest_version`: the admission rule above with
    one batch as the unit, i.e. `batch_index - latest_version <= staleness_bound`."""
    allowed = groups_allowed(1, latest_version, staleness_bound)
    return allowed is None or batch_index + 1 <= allowed


def cutoff_due_s(first_end_s: float | None, train_unfinished_after_s: float | None) -> float | None:
    """The time at which a group whose first member ended at `first_end_s` is scored even with
    members still running; None when no member ended yet or partial-progress scoring is off."""
    if first_end_s is None or train_unfinished_after_s is None:
        return None
    return first_end_s + train_unfinished_after_s


def group_ready(
    all_ended: bool, first_end_s: float | None, now_s: float, train_unfinished_after_s: float | None
) -> bool:
    """Whether a group is scored at `now_s`: every member has ended (and, live, has all its calls
    stored), or the partial-progress cut-off after its first end has passed."""
    if all_ended:
        return True
    due = cutoff_due_s(first_end_s, train_unfinished_after_s)
    return due is not None and now_s >= due
