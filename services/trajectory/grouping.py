"""One ready group -> scores, dedup decisions and the representatives the packer trains.

The order is fixed: score every execution (raising on bad rewards before anything changes),
compute GRPO advantages over *every* execution (so exact merges do not change mean or std),
merge exact duplicates, down-weight near duplicates, and give each representative the mean
advantage and the reward sum of the members it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.trajectory.dedup import GroupDedup, dedup_group
from services.trajectory.packing import PackedExecution, ScoredGroup
from services.trajectory.scoring import GroupStats, Outcome, Score, Scorer, group_advantages
from services.trajectory.tree import TaskTree


@dataclass(slots=True)
class GroupResult:
    group: ScoredGroup
    scores: dict[str, Score]
    advantages: dict[str, float]
    stats: GroupStats
    dedup: GroupDedup


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
) -> GroupResult:
    """Score, dedup and weight one group; raises InvalidArgument (changing nothing) on a bad score."""
    eids = sorted(e for e in outcomes if e in tree.calls_by_execution)
    scores = {e: scorer.score(outcomes[e]) for e in eids}
    stats = group_advantages([scores[e].reward for e in eids], normalise_std=normalise_std)
    adv = dict(zip(eids, stats.advantages, strict=True))
    dd = dedup_group(tree, eids, threshold=near_threshold, num_perm=num_perm, shingle_size=shingle_size)
    reps = [
        PackedExecution(
            execution_id=rep,
            advantage=sum(adv[m] for m in members) / len(members),
            multiplicity=len(members),
            dedup_weight=dd.weights[rep],
            reward_sum=sum(scores[m].reward for m in members),
            num_partial=sum(1 for m in members if scores[m].partial),
        )
        for rep, members in dd.members.items()
    ]
    return GroupResult(ScoredGroup(group_id, tree.task_id, reps), scores, adv, stats, dd)
