"""Simulator tests: calibration against published measurements, equal work, and the CLI contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.scheduler.policies import AsyncPolicy, ColocatePolicy, ElasticPolicy
from services.scheduler.sim import builtin, load_workload_file, predict, simulate
from services.scheduler.sim.cli import main as sim_main
from services.scheduler.sim.sample import sample_executions

SMALL = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "small.yaml"


@pytest.fixture(scope="module")
def xlong_colocate():
    return simulate(builtin("xlong"), ColocatePolicy())


def test_colocate_on_xlong_spends_70_to_90_percent_of_the_step_in_rollout(xlong_colocate) -> None:
    # Seer Table 1 (~80%), RollPacker / ROLL Flash (~70%), agentic RL blogs (80-90%).
    assert 0.70 <= xlong_colocate.rollout_share <= 0.90


def test_last_tenth_of_xlong_executions_take_at_least_40_percent_of_rollout(xlong_colocate) -> None:
    # Seer: the last 10% of requests take up to 50% of rollout time.
    assert xlong_colocate.tail_share >= 0.40


def test_xlong_executions_match_the_papers_setting() -> None:
    w = builtin("xlong")
    execs = [e for step in sample_executions(w) for e in step]
    lengths = [e.final_context for e in execs]
    turns = [len(e.gen) for e in execs]
    assert 550_000 <= sum(lengths) / len(lengths) <= 800_000
    assert max(lengths) <= 1_000_000 + 1
    assert 100 <= sum(turns) / len(turns) <= 700
    assert w.num_devices == 64


def test_every_policy_trains_the_same_executions_and_elastic_keeps_the_bound() -> None:
    w = load_workload_file(SMALL)
    for policy in (ColocatePolicy(), AsyncPolicy(2, staleness_bound=1), ElasticPolicy(staleness_bound=1)):
        r = simulate(w, policy)
        assert len(r.step_done_s) == w.num_steps
        assert r.max_staleness <= policy.staleness_bound
        assert r.num_parked == 0
    assert simulate(w, ColocatePolicy()).max_staleness == 0


def test_elastic_migrates_live_executions_instead_of_aborting_them() -> None:
    w = builtin("xlong")
    r = simulate(w, ElasticPolicy(staleness_bound=1))
    assert r.num_migrations > 0 and r.num_parked == 0
    assert len(r.step_done_s) == w.num_steps and r.max_staleness <= 1


def test_staleness_bound_zero_makes_elastic_synchronous() -> None:
    w = load_workload_file(SMALL).model_validate(
        {**load_workload_file(SMALL).model_dump(), "staleness_bound": 0}
    )
    assert simulate(w, ElasticPolicy(staleness_bound=0)).max_staleness == 0


def test_predict_returns_the_fields_gyre_compare_reads() -> None:
    out = predict(load_workload_file(SMALL), "async", num_rollout_devices=4)
    assert out["rollout_devices"] == 4
    assert out["time_per_step_s"] > 0 and 0 < out["device_utilization"] <= 1


def test_sim_cli_prints_one_json_object_with_every_policy(capsys, tmp_path) -> None:
    png = tmp_path / "sim.png"
    assert sim_main(["--workload-file", str(SMALL), "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    for name in ("colocate", "async", "elastic"):
        assert {"time_per_step_s", "device_utilization", "max_staleness"} <= set(out[name])
    ratio = out["colocate"]["time_per_step_s"] / out["elastic"]["time_per_step_s"]
    assert out["speedup_vs_colocate"] == pytest.approx(ratio, rel=1e-2)
    assert out["best_async_split"]["rollout_devices"] + out["best_async_split"]["train_devices"] == 8
    assert png.stat().st_size > 10_000


def test_sim_cli_rejects_a_bad_workload_file_with_a_clear_error(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nnum_devices: 7\n")
    assert sim_main(["--workload-file", str(bad)]) == 2
    assert "gyre sim:" in capsys.readouterr().err


def test_predict_reads_the_workload_named_by_a_run_config(tmp_path) -> None:
    run = tmp_path / "run.yaml"
    run.write_text(f"run_id: x\nscheduler:\n  policy: colocate\n  sim_workload: {SMALL}\n")
    out = predict(run, policy=None, measured={"time_per_step_s": 1.0})
    assert out == predict(load_workload_file(SMALL), "colocate")
    assert out["device_idle_fraction"] == pytest.approx(1 - out["device_utilization"], abs=1e-3)


def test_predict_explains_a_run_config_without_a_workload(tmp_path) -> None:
    run = tmp_path / "run.yaml"
    run.write_text("run_id: x\nscheduler:\n  policy: elastic\n")
    with pytest.raises(ValueError, match="sim_workload"):
        predict(run)
