"""A group whose executions all scored alike teaches nothing: its advantages are exactly 0."""

from __future__ import annotations

import pytest

from services.trajectory.scoring import group_advantages


@pytest.mark.parametrize("normalise_std", [True, False])
def test_a_zero_variance_group_gets_exact_zero_advantages_not_amplified_float_noise(
    normalise_std: bool,
) -> None:
    rewards = [0.1 + 0.2] * 7 + [0.3]  # 0.30000000000000004 vs 0.3: the same reward, up to rounding
    st = group_advantages(rewards, normalise_std=normalise_std)
    assert st.advantages == [0.0] * 8 and st.std == 0.0
    assert st.mean == pytest.approx(0.3)


def test_one_different_member_still_gets_the_whole_signal() -> None:
    st = group_advantages([0.5] * 7 + [0.75])
    assert st.advantages[-1] > 2.5 and all(a < 0 for a in st.advantages[:-1])
    assert sum(st.advantages) == pytest.approx(0.0, abs=1e-9)
