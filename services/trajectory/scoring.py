"""Scores of executions and GRPO-style group advantages.

A scorer turns what is known about an execution (how it ended, its final reward, its last
progress signals) into a ``Score``: a reward in the run's range and whether it is *partial*
(estimated from progress because the execution did not finish). Scorers are pluggable: the
config names one by dotted path (``package.module:ClassName``) or a built-in name.

Guarantees
- A NaN, infinite or out-of-range reward or progress value raises ``gyre.errors.InvalidArgument``
  naming the execution, the field and the allowed range; nothing is scored from it.
- Group statistics count every execution, so merging k exact duplicates into one path with
  multiplicity k leaves the group mean and standard deviation unchanged.
"""

from __future__ import annotations

import importlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, Protocol

from gyre.errors import ConfigError, InvalidArgument
from services.trajectory.tree import CallRecord, Node, TaskTree


class Ending(StrEnum):
    """How an execution ended, as far as the trajectory service knows."""

    RUNNING = "running"  # no end event yet (scored only when train_unfinished_after_s allows it)
    FINISHED = "finished"
    TRUNCATED = "truncated"
    FAILED = "failed"


@dataclass(slots=True)
class ProgressSignals:
    """An execution's progress as the trajectory service stores it (from a StepEvent or ExecutionEvent).

    Named apart from the rollout's ``environments.base.Progress``, which an environment reports.
    """

    milestones_reached: int = 0
    milestones_total: int = 0
    tests_passed_fraction: float | None = None
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class Outcome:
    """What a scorer sees of one execution."""

    execution_id: str
    ending: Ending
    reward: float | None
    progress: ProgressSignals


@dataclass(slots=True)
class Score:
    reward: float
    partial: bool
    source: str  # "final", "tests", "milestones", "none"


class Scorer(Protocol):
    def score(self, outcome: Outcome) -> Score: ...


def check_value(value: float, *, what: str, execution_id: str, lo: float, hi: float) -> float:
    """Return ``value`` if finite and in [lo, hi]; else raise InvalidArgument with a clear message."""
    v = float(value)
    if math.isnan(v) or math.isinf(v):
        raise InvalidArgument(
            f"execution {execution_id!r}: {what} is {v!r}; it must be a finite number in [{lo}, {hi}] "
            "(fix the environment's reward function; the event was rejected, nothing else was changed)"
        )
    if not lo <= v <= hi:
        raise InvalidArgument(
            f"execution {execution_id!r}: {what} = {v} is outside the allowed range [{lo}, {hi}] "
            "(set trajectory.reward_min / reward_max if the run's rewards use another range)"
        )
    return v


def validate_progress(progress: ProgressSignals, execution_id: str) -> None:
    """Reject progress signals that cannot be scored (NaN, fraction outside [0, 1], reached > total)."""
    if progress.tests_passed_fraction is not None:
        check_value(
            progress.tests_passed_fraction,
            what="tests_passed_fraction",
            execution_id=execution_id,
            lo=0,
            hi=1,
        )
    if progress.milestones_total < 0 or not 0 <= progress.milestones_reached <= max(
        progress.milestones_total, 0
    ):
        if progress.milestones_total or progress.milestones_reached:
            raise InvalidArgument(
                f"execution {execution_id!r}: milestones_reached={progress.milestones_reached} must lie in "
                f"[0, milestones_total={progress.milestones_total}]"
            )
    for name, value in progress.extra.items():
        if math.isnan(value) or math.isinf(value):
            raise InvalidArgument(
                f"execution {execution_id!r}: progress.extra[{name!r}] is {value!r}; it must be finite"
            )


class ProgressScorer:
    """Final reward when finished; otherwise partial progress scaled into the reward range.

    Partial reward = reward_min + partial_scale * fraction * (reward_max - reward_min), where
    fraction is ``tests_passed_fraction`` when the environment has tests, else
    ``milestones_reached / milestones_total``, else 0 (source "none").
    """

    def __init__(self, reward_min: float = 0.0, reward_max: float = 1.0, partial_scale: float = 1.0) -> None:
        if not reward_min < reward_max:
            raise ConfigError(f"reward_min ({reward_min}) must be smaller than reward_max ({reward_max})")
        self.lo, self.hi, self.partial_scale = reward_min, reward_max, partial_scale

    def score(self, outcome: Outcome) -> Score:
        validate_progress(outcome.progress, outcome.execution_id)
        if outcome.ending is Ending.FINISHED:
            if outcome.reward is None:
                raise InvalidArgument(f"execution {outcome.execution_id!r} FINISHED without a reward")
            r = check_value(
                outcome.reward, what="reward", execution_id=outcome.execution_id, lo=self.lo, hi=self.hi
            )
            return Score(r, False, "final")
        p = outcome.progress
        if p.tests_passed_fraction is not None:
            frac, source = p.tests_passed_fraction, "tests"
        elif p.milestones_total > 0:
            frac, source = p.milestones_reached / p.milestones_total, "milestones"
        else:
            frac, source = 0.0, "none"
        return Score(self.lo + self.partial_scale * frac * (self.hi - self.lo), True, source)


def load_scorer(name: str, reward_min: float, reward_max: float, partial_scale: float) -> Scorer:
    """Built-in "progress", or "package.module:Class" constructed with the same keyword arguments."""
    if name == "progress":
        return ProgressScorer(reward_min, reward_max, partial_scale)
    if ":" not in name:
        raise ConfigError(f"scorer {name!r}: use 'progress' or a dotted path 'package.module:ClassName'")
    module, _, attr = name.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    scorer: Scorer = cls(reward_min=reward_min, reward_max=reward_max, partial_scale=partial_scale)
    return scorer


@dataclass(slots=True)
class GroupStats:
    mean: float
    std: float
    advantages: list[float]  # one per member, in input order


ZERO_VARIANCE_SPREAD = 1e-9  # rewards closer than this are the same reward


def group_advantages(
    rewards: Sequence[float], *, normalise_std: bool = True, eps: float = 1e-6
) -> GroupStats:
    """GRPO advantages: (r - mean) / (std + eps) over *every* member (duplicates included).

    Pass one reward per execution (not per deduplicated path), so multiplicity is counted; the
    advantage of a merged path is then the mean of its members' advantages. A group whose rewards
    all agree (zero variance: every member scored alike) gets advantages of exactly 0, not float
    noise amplified by 1/eps: it carries no learning signal (the run report counts such groups;
    many of them while the reward is below the oracle's is a stall).
    """
    n = len(rewards)
    if n == 0:
        return GroupStats(0.0, 0.0, [])
    mean = sum(rewards) / n
    if max(rewards) - min(rewards) <= ZERO_VARIANCE_SPREAD:
        return GroupStats(mean, 0.0, [0.0] * n)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    scale = (std + eps) if normalise_std else 1.0
    return GroupStats(mean, std, [(r - mean) / scale for r in rewards])


def node_values(paths: dict[str, list[int]], rewards: dict[str, float]) -> dict[int, float]:
    """Value of each node = mean reward of the executions whose paths pass through it."""
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for eid, nodes in paths.items():
        for nid in nodes:
            sums[nid] = sums.get(nid, 0.0) + rewards[eid]
            counts[nid] = counts.get(nid, 0) + 1
    return {nid: sums[nid] / counts[nid] for nid in sums}


# ---------------------------------------------------------------------------------- credit assignment
CreditAssignment = Literal["execution", "progress", "tree"]
"""How a group's rewards become per-token advantages (``trajectory.credit_assignment``):

- ``execution``: GRPO, one advantage per execution (``group_advantages``) on every token it generated.
- ``progress``: per-call advantages from the progress the environment reported after each call
  (``progress_call_advantages``): each call is credited with the progress it made.
- ``tree``: per-call advantages from the task tree (``tree_call_advantages``): what each call's
  completion changed in the value of the tree node it left, on top of the execution's GRPO term.
"""


def prompt_node(rec: CallRecord) -> Node | None:
    """The node holding the call's last prompt token (the state the call was made in); None when
    the prompt is empty (the call starts at the root)."""
    n: Node | None = rec.end_node
    while n is not None and n.node_id >= 0 and n.start >= rec.prompt_len:
        n = n.parent
    return n if n is not None and n.node_id >= 0 else None


def tree_call_advantages(
    tree: TaskTree, rewards: dict[str, float], *, local_coef: float = 1.0, global_coef: float = 0.0
) -> dict[str, dict[int, float]]:
    """Per-call advantages of a group's executions from tree node values (TreeRL-style).

    ``rewards`` holds one reward per execution of the group (every member, duplicates included).
    The value of a node, ``V(n)``, is the mean reward of the group's executions whose calls pass
    through n (``node_values``); ``V0`` is the group mean. For call c of execution e, with
    ``before`` the node of its last prompt token and ``after`` the node it ends at:

        A(e, c) = global_coef * (V(after) - V0) + local_coef * (V(after) - V(before))

    The *local* term is the change of value the call's own completion made: where executions that
    shared everything up to the call took different actions, it compares them with each other, so
    an action is credited with what followed *it*, not with what the execution did elsewhere;
    where nobody else shared the prompt (a single-execution branch) it is 0. Without context
    rewriting the local terms of a call chain telescope to ``r_e - V(first prompt node)``;
    compaction re-merges executions whose rewritten prompts agree, so those calls are compared
    with every execution that reached the same rewritten prompt. The *global* term is the GRPO
    advantage ``r_e - V0`` wherever the execution is alone, and a lower-variance estimate of it (a
    mean over the executions sharing the node) where it is not.

    A group whose rewards all agree gets exactly 0 on every call (no signal, as ``group_advantages``).
    Units: reward units (no std normalisation).
    """
    eids = sorted(e for e in rewards if e in tree.calls_by_execution)
    out: dict[str, dict[int, float]] = {e: {} for e in eids}
    if not eids:
        return out
    vals = [rewards[e] for e in eids]
    if max(vals) - min(vals) <= ZERO_VARIANCE_SPREAD:
        for e in eids:
            out[e] = {seq: 0.0 for seq in tree.calls_by_execution[e]}
        return out
    values = node_values({e: sorted(tree.nodes_of([e])) for e in eids}, {e: rewards[e] for e in eids})
    v0 = sum(vals) / len(vals)
    for e in eids:
        for seq, rec in tree.calls_by_execution[e].items():
            before = prompt_node(rec)
            v_before = values[before.node_id] if before is not None else v0
            v_after = values[rec.end_node.node_id]
            out[e][seq] = global_coef * (v_after - v0) + local_coef * (v_after - v_before)
    return out


def progress_call_advantages(
    potentials: dict[str, list[float]],
    *,
    discount: float = 0.0,
    normalise_std: bool = False,
    eps: float = 1e-6,
) -> dict[str, list[float]]:
    """Per-call advantages from the progress an execution reported after each call.

    ``potentials[e]`` = [Phi_0, Phi_1, ..., Phi_n]: the score of e's progress before its first call
    (Phi_0) and after each of its n calls, the last being e's score (final reward or partial).
    Call k earns r_k = Phi_{k+1} - Phi_k (so sum_k r_k = score - Phi_0); with rbar the mean r over
    every call of the group, its advantage is A_k = sum_{j>=k} discount^(j-k) (r_j - rbar) / s,
    s = 1, or the std of the r's (+ eps) with ``normalise_std``. GRPO with process supervision
    (Shao et al. 2024); a group whose calls all made the same progress gets exactly 0 everywhere.
    Units: score units (per std with ``normalise_std``), one list per execution in call order.
    """
    steps = {e: [phi[k + 1] - phi[k] for k in range(len(phi) - 1)] for e, phi in potentials.items()}
    flat = [r for r in itertools.chain.from_iterable(steps.values())]
    if not flat or max(flat) - min(flat) <= ZERO_VARIANCE_SPREAD:
        return {e: [0.0] * len(r) for e, r in steps.items()}
    rbar = sum(flat) / len(flat)
    scale = math.sqrt(sum((r - rbar) ** 2 for r in flat) / len(flat)) + eps if normalise_std else 1.0
    out: dict[str, list[float]] = {}
    for e, r in steps.items():
        a = [0.0] * len(r)
        acc = 0.0
        for k in range(len(r) - 1, -1, -1):
            acc = (r[k] - rbar) / scale + discount * acc
            a[k] = acc
        out[e] = a
    return out


def has_signal(p: ProgressSignals) -> bool:
    """Whether a progress report says anything (milestones or a tests fraction)."""
    return p.milestones_total > 0 or p.tests_passed_fraction is not None


def call_potentials(
    scorer: Scorer,
    execution_id: str,
    score: float,
    call_seqs: Sequence[int],
    step_progress: dict[int, ProgressSignals],
) -> list[float]:
    """[Phi_0, ..., Phi_n] for ``progress_call_advantages``: the scorer's partial score of no
    progress, then of the progress reported after each call but the last (a call whose step
    carried no signal keeps the previous value), then the execution's score."""
    phi = [scorer.score(Outcome(execution_id, Ending.RUNNING, None, ProgressSignals())).reward]
    for k in list(call_seqs)[:-1]:
        p = step_progress.get(k)
        if p is None or not has_signal(p):
            phi.append(phi[-1])
        else:
            phi.append(scorer.score(Outcome(execution_id, Ending.RUNNING, None, p)).reward)
    phi.append(score)
    return phi
