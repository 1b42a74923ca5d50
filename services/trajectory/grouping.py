"""One ready group -> scores, dedup decisions and the representatives the packer trains.

The order is fixed: score every execution (raising on bad rewards before anything changes),
compute GRPO advantages over *every* execution (so exact merges do not change mean or std),
merge exact duplicates, down-weight near duplicates, and give each representative the mean
advantage and the reward sum of the members it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.trajectory.dedup import GroupDedup, dedup_group
from services.trajectory.packing import PackedExecution, ScoredGroup
from services.trajectory.scoring import (
    CreditAssignment,
    GroupStats,
    Outcome,
    ProgressSignals,
    Score,
    Scorer,
    call_potentials,
    group_advantages,
    progress_call_advantages,
    tree_call_advantages,
)
from services.trajectory.tree import TaskTree


@dataclass(slots=True)
class GroupResult:
    group: ScoredGroup
    scores: dict[str, Score]
    advantages: dict[str, float]
    stats: GroupStats
    dedup: GroupDedup
    call_advantages: dict[str, dict[int, float]] = field(default_factory=dict)  # per-call credit only

    @property
    def advantage_abs_max(self) -> float:
        """Largest |advantage| any generated token of the group is trained with (0: the group
        teaches nothing). Under per-call credit a group whose final rewards agree can still teach."""
        trained = [a for calls in self.call_advantages.values() for a in calls.values()]
        return max((abs(a) for a in trained or list(self.advantages.values())), default=0.0)


def score_group(
    tree: TaskTree,
    group_id: str,
    outcomes: dict[str, Outcome],
    scorer: Scorer,
    *,
    normalise_std: bool = True,
    near_threshold: float = 0.9,
    num_perm: int = 128,
    shingle_size: int = 4,
    credit: CreditAssignment = "execution",
    tree_local_coef: float = 1.0,
    tree_global_coef: float = 0.0,
    step_progress: dict[str, dict[int, ProgressSignals]] | None = None,
    progress_discount: float = 0.0,
) -> GroupResult:
    """Score, dedup and weight one group; raises InvalidArgument (changing nothing) on a bad score.

    ``credit`` chooses the advantages (services/trajectory/scoring.py, ``CreditAssignment``): one
    per execution, or one per call from the tree's node values (then ``advantages`` still holds
    each execution's GRPO advantage, for the score rows, and ``call_advantages`` what is trained)."""
    eids = sorted(e for e in outcomes if e in tree.calls_by_execution)
    scores = {e: scorer.score(outcomes[e]) for e in eids}
    stats = group_advantages([scores[e].reward for e in eids], normalise_std=normalise_std)
    adv = dict(zip(eids, stats.advantages, strict=True))
    call_adv: dict[str, dict[int, float]] = {}
    if credit == "tree":
        call_adv = tree_call_advantages(
            tree,
            {e: scores[e].reward for e in eids},
            local_coef=tree_local_coef,
            global_coef=tree_global_coef,
        )
    elif credit == "progress":
        seqs = {e: sorted(tree.calls_by_execution[e]) for e in eids}
        per_call = progress_call_advantages(
            {
                e: call_potentials(scorer, e, scores[e].reward, seqs[e], (step_progress or {}).get(e, {}))
                for e in eids
            },
            discount=progress_discount,
            normalise_std=normalise_std,
        )
        call_adv = {e: dict(zip(seqs[e], per_call[e], strict=True)) for e in eids}
    dd = dedup_group(tree, eids, threshold=near_threshold, num_perm=num_perm, shingle_size=shingle_size)
    reps = [
        PackedExecution(
            execution_id=rep,
            advantage=sum(adv[m] for m in members) / len(members),
            multiplicity=len(members),
            dedup_weight=dd.weights[rep],
            reward_sum=sum(scores[m].reward for m in members),
            num_partial=sum(1 for m in members if scores[m].partial),
            call_advantages=_mean_call_advantages([call_adv[m] for m in members]) if call_adv else {},
        )
        for rep, members in dd.members.items()
    ]
    return GroupResult(ScoredGroup(group_id, tree.task_id, reps), scores, adv, stats, dd, call_adv)


def _mean_call_advantages(members: list[dict[int, float]]) -> dict[int, float]:
    """Per call_seq, the mean over the members (exact duplicates: the same calls, so the same keys)."""
    seqs = sorted({s for m in members for s in m})
    return {s: sum(m.get(s, 0.0) for m in members) / len(members) for s in seqs}
