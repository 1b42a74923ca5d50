"""Checks of a StepEvent's (and an ExecutionEvent's, `execution_problem`) content, run where it is
produced (rollout) and where it is consumed (trajectory), so one definition of "valid" holds at
both ends.

`step_problem` returns None for a valid step, or a `Problem`: a short `code` (the label of the
dead-letter counter) and a one-line `reason` naming the field and the value. It checks:

* identity: run, task, group and execution ids present, ``call_seq >= 0``;
* sizes: completion ids, log-probs and versions of equal length; at least one token; at most
  `max_tokens` tokens in the prompt plus completion;
* vocabulary: every prompt and completion token id in ``[0, vocab_size)`` (when `vocab_size` is set);
* log-probs: finite and ``<= 0`` (natural log; up to 1e-3 above 0 is float noise and passes);
* progress signals: tests fraction in [0, 1], milestones reached <= total, extra values finite;
* versions: every completion version ``>= 0`` and, when `latest_version` is set, not ahead of it by
  more than `max_version_lead`. A step ahead by at most that lead is not invalid but *early*
  (`is_early`): the consumer has not seen that weights event yet and retries it later.

It does not look at the trajectory store (duplicates, compact-prompt bases): that is the consumer's
job after these checks passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gyre.v1 import common_pb2, events_pb2

# Largest prompt + completion of one call, in tokens (the design's long-horizon ceiling is ~1M per rollout).
MAX_STEP_TOKENS = 2_000_000
# Log-probs up to this much above 0 are float rounding, not an error.
LOGPROB_SLACK = 1e-3


@dataclass(frozen=True)
class Problem:
    """Why a message is invalid: `code` labels the counter, `reason` says what and where."""

    code: str
    reason: str


def _where(step: events_pb2.StepEvent) -> str:
    return f"step {step.execution_id or '?'}.{step.call_seq}"


def step_problem(
    step: events_pb2.StepEvent,
    *,
    vocab_size: int | None = None,
    latest_version: int | None = None,
    max_version_lead: int = 0,
    max_tokens: int = MAX_STEP_TOKENS,
) -> Problem | None:
    """None if `step` is valid under these limits, else the first Problem found (module docstring)."""
    where = _where(step)
    for name in ("run_id", "task_id", "group_id", "execution_id"):
        if not getattr(step, name):
            return Problem("missing_id", f"{where}: {name} is empty")
    if step.call_seq < 0:
        return Problem("bad_call_seq", f"{where}: call_seq must be >= 0")
    n = len(step.completion_token_ids)
    if not n == len(step.completion_logprobs) == len(step.completion_versions):
        return Problem(
            "length_mismatch",
            f"{where}: completion_token_ids ({n}), completion_logprobs ({len(step.completion_logprobs)}) and "
            f"completion_versions ({len(step.completion_versions)}) differ in length",
        )
    total = n + len(step.prompt_token_ids)
    if total == 0:
        return Problem("empty", f"{where}: no prompt and no completion tokens")
    if total > max_tokens:
        return Problem("too_long", f"{where}: {total} tokens, more than the limit of {max_tokens}")
    if vocab_size is not None:
        for field in ("prompt_token_ids", "completion_token_ids"):
            ids = np.asarray(getattr(step, field), dtype=np.int64)
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
                return Problem(
                    "token_out_of_vocab",
                    f"{where}: {field} holds token id {bad}, outside the vocabulary [0, {vocab_size})",
                )
    if n:
        lp = np.asarray(step.completion_logprobs, dtype=np.float64)
        if not bool(np.isfinite(lp).all()) or float(lp.max()) > LOGPROB_SLACK:
            return Problem("bad_logprob", f"{where}: completion_logprobs must be finite and <= 0")
        versions = np.asarray(step.completion_versions, dtype=np.int64)
        if int(versions.min()) < 0:
            return Problem("bad_version", f"{where}: completion_versions must be >= 0")
        if latest_version is not None and int(versions.max()) > latest_version + max_version_lead:
            return Problem(
                "version_ahead",
                f"{where}: completion version {int(versions.max())} is ahead of the latest published "
                f"weights version {latest_version} (by more than {max_version_lead})",
            )
    if step.HasField("progress"):
        return _progress_problem(step.progress, where)
    return None


def is_early(step: events_pb2.StepEvent, latest_version: int) -> bool:
    """True if a (valid) step carries a version newer than `latest_version`: its weights event has
    not reached this consumer yet, so it should be retried rather than stored or refused."""
    return bool(len(step.completion_versions)) and max(step.completion_versions) > latest_version


def _progress_problem(p: common_pb2.ProgressSignal, where: str) -> Problem | None:
    if p.HasField("tests_passed_fraction") and not 0.0 <= p.tests_passed_fraction <= 1.0:
        return Problem(
            "bad_progress", f"{where}: tests_passed_fraction {p.tests_passed_fraction} is not in [0, 1]"
        )
    if (p.milestones_total or p.milestones_reached) and not 0 <= p.milestones_reached <= max(
        p.milestones_total, 0
    ):
        return Problem(
            "bad_progress",
            f"{where}: milestones_reached={p.milestones_reached} must lie in [0, milestones_total={p.milestones_total}]",
        )
    for name, value in p.extra.items():
        if not math.isfinite(value):
            return Problem(
                "bad_progress", f"{where}: progress.extra[{name!r}] is {value!r}; it must be finite"
            )
    return None


def execution_problem(
    event: events_pb2.ExecutionEvent, *, reward_range: tuple[float, float] | None = None
) -> Problem | None:
    """None if an ExecutionEvent is valid, else the first Problem: ids present, a known kind,
    ``num_calls >= 0``, a finite reward (inside `reward_range` when given) and sane progress signals
    (fraction in [0, 1], milestones reached <= total, extra values finite)."""
    where = f"execution event {event.event_id or event.execution_id or '?'}"
    for name in ("run_id", "task_id", "group_id", "execution_id"):
        if not getattr(event, name):
            return Problem("missing_id", f"{where}: {name} is empty")
    if event.kind not in events_pb2.ExecutionEvent.Kind.values():
        return Problem("bad_kind", f"{where}: unknown kind {event.kind}")
    if event.num_calls < 0:
        return Problem("bad_num_calls", f"{where}: num_calls must be >= 0")
    if event.HasField("reward"):
        if not math.isfinite(event.reward):
            return Problem("bad_reward", f"{where}: reward {event.reward!r} is not finite")
        if reward_range is not None and not reward_range[0] <= event.reward <= reward_range[1]:
            return Problem(
                "bad_reward",
                f"{where}: reward {event.reward} is outside [{reward_range[0]}, {reward_range[1]}]",
            )
    return _progress_problem(event.progress, where)
