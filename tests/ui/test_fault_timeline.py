"""The dashboard's device lanes mark every fault and recovery (app/job/faults.py), over a SYNTHETIC
run directory: tests/job/conftest.py's event log and tests/helpers/run_faults.py's fault files. The
overview's HTML is rendered in-process (the SVG is drawn on the server: no browser needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.ui import pages
from app.ui.data import read_run
from tests.helpers.run_faults import write_fault_files
from tests.job.conftest import T0, write_synthetic_run


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    write_synthetic_run(tmp_path, num_steps=6, reward_slope=0.0)
    write_fault_files(tmp_path, T0)
    return tmp_path


def test_the_run_view_holds_one_fault_marker_per_fault_with_its_span_until_back(run_dir: Path) -> None:
    view = read_run(run_dir)
    faults = [m for m in view.markers if m.kind in ("fault", "stall")]
    assert [(m.kind, m.target) for m in faults] == [
        ("fault", "scheduler"),
        ("fault", "engine"),
        ("fault", "postgres"),
        ("fault", "scheduler"),
        ("fault", "trainer"),
        ("stall", "stall"),
    ]
    assert all(m.device_id == "" for m in faults)  # across every lane
    assert faults[0].t_s == pytest.approx(9.9) and faults[0].until_s == pytest.approx(11.6)
    assert faults[4].until_s is None
    assert any(m.kind == "reassign" for m in view.markers)  # the lane markers are still there


def test_the_overview_draws_each_fault_across_the_lanes_with_a_legend_entry(run_dir: Path) -> None:
    html = pages.overview(read_run(run_dir))
    lanes = re.search(r'<svg class="lanes".*?</svg>', html, re.S)
    assert lanes is not None
    drawn = re.findall(r'<g class="marker (fault|stall)" data-kind="\w+" data-target="([\w-]+)"', lanes[0])
    assert drawn == [
        ("fault", "scheduler"),
        ("fault", "engine"),
        ("fault", "postgres"),
        ("fault", "scheduler"),
        ("fault", "trainer"),
        ("stall", "stall"),
    ]
    assert lanes[0].count('class="recovery"') == 6
    assert "fault, shaded until back" in lanes[0]
    assert "scheduler killed by gyre chaos (SIGKILL) at 9.9 s, back after 1.7 s" in lanes[0]
    assert 'data-until-s=""' in lanes[0]  # the trainer never came back


def test_a_run_without_faults_draws_no_fault_marker(tmp_path: Path) -> None:
    write_synthetic_run(tmp_path, num_steps=2, reward_slope=0.0)
    view = read_run(tmp_path)
    assert not [m for m in view.markers if m.kind in ("fault", "stall")]
    assert '<g class="marker fault"' not in pages.overview(view)
