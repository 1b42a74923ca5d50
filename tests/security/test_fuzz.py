"""`gyre fuzz` in CI: a few examples per target (the command runs 10,000 each), with real servers."""

from hypothesis import strategies as st

from app.fuzz import TargetReport, all_targets, fuzz, run_target


def test_a_short_fuzz_run_reaches_every_target_and_finds_no_crash_and_no_lost_step() -> None:
    summary = fuzz(25)
    assert set(summary["targets"]) == set(all_targets())
    assert all(t["examples"] == 25 for t in summary["targets"].values())
    crashes = {name: t["first_crash"] for name, t in summary["targets"].items() if t["crashes"]}
    assert crashes == {}
    assert summary["bad_accepted"] == 0 and summary["good_lost"] == 0
    chat = summary["targets"]["http.chat"]["outcomes"]
    assert chat.get("400", 0) > 0 and chat.get("401", 0) + chat.get("200", 0) > 0


def test_the_harness_counts_a_crash_and_keeps_going() -> None:
    report = TargetReport()

    def check(value: int) -> None:
        if value % 2:
            raise ValueError(f"odd {value}")

    run_target(report, st.integers(0, 1000), check, 50)
    assert report.examples == 50 and 0 < report.crashes < 50 and "ValueError" in report.first_crash
