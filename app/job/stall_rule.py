"""The learning-stall rule (app/job/analysis.py `detect_stall` applies it): its thresholds, its words
and the warning it gives, shared by the report and the live progress line."""

from __future__ import annotations

from dataclasses import dataclass

STALL_WINDOW_STEPS = 10
STALL_ZERO_VARIANCE = 0.5
STALL_REWARD_FRACTION = 0.9
STALL_RULE = (
    f"stalled iff, over {STALL_WINDOW_STEPS} consecutive trainer steps, at least {STALL_ZERO_VARIANCE:.0%} of "
    f"the scored groups have zero variance (equal rewards, every advantage 0: no learning signal) while the mean reward "
    f"is below {STALL_REWARD_FRACTION:.0%} of the oracle's"
)


@dataclass(frozen=True)
class StallWarning:
    """Steps `first_step`..`last_step` met the stall rule (STALL_RULE); numbers pooled over them."""

    first_step: int
    last_step: int
    zero_variance_fraction: float
    reward: float
    oracle: float
    oracle_reported: bool
    recovered: bool = False  # the last steps of the run no longer met the rule
    rule: str = STALL_RULE

    def message(self) -> str:
        oracle = (
            f"the oracle's {self.oracle:.3f}"
            if self.oracle_reported
            else f"{self.oracle:.3f} (no oracle reported)"
        )
        advice = (
            f"groups carried a learning signal again after step {self.last_step}"
            if self.recovered
            else "raise trainer.entropy_coef, lower trainer.lr, or sample larger groups"
        )
        return (
            f"WARNING learning stalled in steps {self.first_step}-{self.last_step}: "
            f"{self.zero_variance_fraction:.0%} of groups had zero variance (no learning signal) "
            f"while the reward was {self.reward:.3f}, below {oracle}; {advice}"
        )
