"""Simulator tests: the modelled live semantics (KV admission, trainer resize, partial progress), equal
work, multi-seed intervals and the CLI contract. Small workloads only: seconds on 2 cores."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gyre.costmodel import CostModel
from gyre.workload import ServiceSemantics, Workload
from services.scheduler.policies import AsyncPolicy, ColocatePolicy, ElasticPolicy, PoolSnapshot, Role
from services.scheduler.sim import builtin, load_workload_file, predict, simulate
from services.scheduler.sim.cli import main as sim_main
from services.scheduler.sim.compare import SeedComparison, compare_seeds, interval, with_semantics
from services.scheduler.sim.engine import Simulation
from services.scheduler.sim.sample import sample_executions
from services.scheduler.split_meter import SplitMeter

SMALL = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "small.yaml"


def _small(**service: object) -> Workload:
    w = load_workload_file(SMALL)
    return with_semantics(w, w.service.model_copy(update=service)) if service else w


def test_the_simulator_prices_with_the_runtime_cost_model() -> None:
    w = builtin("xlong")
    assert isinstance(w.cost_model(), CostModel)
    assert w.cost_model().decode_step_s(0) == pytest.approx(64e9 / (4 * 4.8e12 * 0.8))


def test_xlong_executions_match_the_papers_setting() -> None:
    w = builtin("xlong")
    execs = [e for step in sample_executions(w) for e in step]
    lengths = [e.final_context for e in execs]
    turns = [len(e.gen) for e in execs]
    assert 550_000 <= sum(lengths) / len(lengths) <= 800_000
    assert max(lengths) <= 1_000_000 + 1
    assert 100 <= sum(turns) / len(turns) <= 700
    assert w.num_devices == 64


@pytest.mark.parametrize("resize", ["microbatch", "step"])
def test_every_policy_trains_every_batch_within_kv_budget_and_bound(resize: str) -> None:
    w = _small(trainer_resize=resize)
    for policy in (ColocatePolicy(), AsyncPolicy(2, staleness_bound=1), ElasticPolicy(staleness_bound=1)):
        r = simulate(w, policy)
        assert len(r.step_done_s) == w.num_steps
        assert r.max_staleness <= policy.staleness_bound
        assert 0 < r.kv_peak_share <= 1.0
        assert r.generated_trained_share == pytest.approx(1.0)  # no cut-off configured: all trained


def test_admission_is_against_actual_kv_size_and_over_budget_turns_are_paid() -> None:
    # One engine budget holds ~3.4 executions of 100K tokens; a max batch of 8 would overfill it.
    w = _small()
    execs = sample_executions(w)
    r = Simulation(AsyncPolicy(1, staleness_bound=1), w, execs, engine_capacity=64).run()
    assert r.kv_peak_share <= 1.0
    big = w.model_copy(
        update={
            "domains": [
                w.domains[0].model_copy(
                    update={"context_median_tokens": 300_000, "context_cap_tokens": 600_000}
                )
            ]
        }
    )
    rb = Simulation(AsyncPolicy(1, staleness_bound=1), big, sample_executions(big), engine_capacity=64).run()
    assert rb.kv_peak_share <= 1.0 and rb.num_preemptions > 0


def test_a_workload_whose_longest_execution_cannot_fit_one_engine_is_refused() -> None:
    data = load_workload_file(SMALL).model_dump()
    data["domains"][0]["context_cap_tokens"] = 5_000_000
    with pytest.raises(ValueError, match="does not fit"):
        Workload.model_validate(data)


def test_step_resize_is_never_faster_than_microbatch_resize_for_elastic() -> None:
    # A fixed home, so that the split meter's probes (which follow the step times) are the same in both.
    micro = simulate(
        _small(trainer_resize="microbatch"), ElasticPolicy(staleness_bound=1, home_rollout_devices=2)
    )
    step = simulate(_small(trainer_resize="step"), ElasticPolicy(staleness_bound=1, home_rollout_devices=2))
    assert micro.time_per_step_s <= step.time_per_step_s * 1.001
    assert micro.tokens_trained_per_step == step.tokens_trained_per_step  # same work


def test_partial_progress_trains_cut_executions_and_reports_the_share() -> None:
    full = simulate(_small(), AsyncPolicy(2, staleness_bound=1))
    cut = simulate(_small(train_unfinished_after_s=60.0), AsyncPolicy(2, staleness_bound=1))
    assert full.generated_trained_share == pytest.approx(1.0)
    assert 0 < cut.generated_trained_share < 1.0
    assert cut.tokens_trained_per_step < full.tokens_trained_per_step


def test_batch_synchronous_trainer_is_never_faster_than_the_streaming_one_under_async() -> None:
    stream = simulate(_small(), AsyncPolicy(2, staleness_bound=1))
    sync = simulate(_small(trainer_streaming=False), AsyncPolicy(2, staleness_bound=1))
    assert stream.time_per_step_s <= sync.time_per_step_s * 1.001


def test_staleness_bound_zero_makes_elastic_synchronous() -> None:
    w = load_workload_file(SMALL).model_copy(update={"staleness_bound": 0})
    assert simulate(w, ElasticPolicy(staleness_bound=0)).max_staleness == 0


def test_seeds_give_a_mean_inside_a_95_percent_interval() -> None:
    out = compare_seeds(load_workload_file(SMALL), 3).to_json()
    assert out["seeds"] == [7, 8, 9]
    for v in out["speedup"].values():
        assert v["low"] <= v["mean"] <= v["high"]
    assert interval([1.0, 1.0, 1.0]) == {"mean": 1.0, "low": 1.0, "high": 1.0}


def test_the_reused_split_row_runs_each_seed_at_the_other_seeds_best_splits_and_makespans_are_reported() -> (
    None
):
    result = compare_seeds(load_workload_file(SMALL), 2)
    first, second = result.per_seed
    w = first.workload
    at_second_best = simulate(w, AsyncPolicy(second.best_async_units, staleness_bound=w.staleness_bound))
    assert result.reused_s_per_step[0] == pytest.approx(at_second_best.time_per_step_s)
    out = result.to_json()
    elastic = first.results["elastic"].time_per_step_s
    assert out["speedup_per_seed"]["vs_async_reused"][0] == pytest.approx(
        at_second_best.time_per_step_s / elastic, abs=1e-3
    )
    assert out["async_sweep_runs"] == [len(first.async_sweep), len(second.async_sweep)]
    by_makespan = [
        c.results["async"].step_done_s[-1] / c.results["elastic"].step_done_s[-1] for c in (first, second)
    ]
    assert out["makespan_speedup"]["vs_async"]["mean"] == pytest.approx(sum(by_makespan) / 2, abs=1e-3)
    assert "vs_async_reused" not in SeedComparison(w, [first]).to_json()["speedup"]  # one seed: no other run


def test_predict_returns_the_fields_gyre_compare_reads() -> None:
    out = predict(load_workload_file(SMALL), "async", num_rollout_devices=4)
    assert out["rollout_devices"] == 4
    assert out["time_per_step_s"] > 0 and 0 < out["device_utilization"] <= 1


def test_sim_cli_prints_one_json_object_with_every_row(capsys, tmp_path) -> None:
    png = tmp_path / "sim.png"
    assert sim_main(["--workload-file", str(SMALL), "--json", "--seeds", "2", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    for name in ("colocate", "async", "elastic", "paper_colocate", "paper_async"):
        assert {"time_per_step_s", "tokens_trained_per_step", "generated_trained_share"} <= set(out[name])
    per_seed = out["speedup_per_seed"]["vs_colocate"]
    assert out["speedup"]["vs_colocate"]["mean"] == pytest.approx(sum(per_seed) / len(per_seed), abs=2e-3)
    assert png.stat().st_size > 10_000


def test_sim_cli_rejects_a_bad_workload_file_with_a_clear_error(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nnum_devices: 7\n")
    assert sim_main(["--workload-file", str(bad)]) == 2
    assert "gyre sim:" in capsys.readouterr().err
    assert sim_main(["--workload-file", str(SMALL), "--seeds", "0"]) == 2


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


def test_service_semantics_default_to_what_the_live_services_do() -> None:
    from gyre.costmodel import CostSpec
    from services.scheduler.config import SchedulerConfig
    from services.trajectory.config import TrajectoryConfig

    sem = ServiceSemantics()
    assert (sem.trainer_resize, sem.trainer_streaming) == ("microbatch", True)
    live = TrajectoryConfig()
    assert sem.train_unfinished_after_s == live.train_unfinished_after_s  # the cut-off, off by default
    assert CostSpec().train_microbatch_tokens == live.max_batch_tokens  # one packed batch per round
    assert SchedulerConfig().plan_interval_s == 1.0  # the simulator's plan loop period


def test_every_command_in_the_simulator_doc_parses_and_names_a_real_workload() -> None:
    from gyre.workload import BUILTIN_WORKLOADS
    from services.scheduler.sim.cli import _parser

    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "simulator.md").read_text()
    assert "scripts/gen_simulator_doc.py" in doc  # generated, not pasted
    commands = [line.strip() for line in doc.splitlines() if line.strip().startswith("gyre sim ")]
    assert len(commands) >= 8
    for cmd in commands:
        args = _parser().parse_args(cmd.split("#")[0].split()[2:])
        if args.workload_file:
            assert (root / args.workload_file).is_file(), cmd
        else:
            assert args.workload in BUILTIN_WORKLOADS, cmd


LIGHT_TAIL = SMALL.parent / "light_tail.yaml"


def test_units_that_finish_a_role_change_together_all_take_executions() -> None:
    # Colocate switches the whole pool at once; the router places the queued batch after every unit
    # of that instant is up. Placing on the first unit alone packed the batch onto it until its KV
    # was full (kv_peak 1.0, turns preempted) while the other 15 engines idled.
    w = load_workload_file(LIGHT_TAIL)
    r = simulate(w, ColocatePolicy())
    assert r.num_preemptions == 0
    assert r.kv_peak_share < 0.5


def _two_engines_one_crowded(w: Workload) -> tuple[Simulation, list[int]]:
    sim = Simulation(AsyncPolicy(2, staleness_bound=1), w, sample_executions(w), engine_capacity=8)
    for u in sim.units[:2]:
        u.role = Role.ROLLOUT
    crowded, eids = sim.units[0], [0, 1, 2]
    for eid in eids:
        e = sim.execs[eid]
        e.ctx = 20_000.0
        sim._attach(e, crowded, sim.cost.kv_bytes(e.ctx))
        crowded.decoding_ctx += e.ctx  # the other two decode while the first starts its turn
    crowded.decoding_ctx -= sim.execs[0].ctx
    return sim, eids


def test_a_turn_moves_to_an_emptier_engine_when_the_decode_time_saved_pays_for_the_kv_copy() -> None:
    w = _small()
    sim, _ = _two_engines_one_crowded(w)
    e = sim.execs[0]
    sim._rebalance(e)
    assert e.unit == 1 and sim.num_rebalanced == 1
    assert e.ready_at == pytest.approx(sim.cost.migration_s(20_000.0))


def test_a_turn_stays_when_the_kv_copy_costs_more_than_it_saves() -> None:
    w = _small()
    slow = w.model_copy(
        update={"hardware": w.hardware.model_copy(update={"migration_bandwidth_bytes_s": 1.0})}
    )
    sim, _ = _two_engines_one_crowded(slow)
    e = sim.execs[0]
    sim._rebalance(e)
    assert e.unit == 0 and sim.num_rebalanced == 0


def test_a_split_meter_handed_to_simulate_is_the_one_the_elastic_run_consults():
    """Studies replace the meter (scripts/elastic_first_move_bound.py); the run must then follow it."""

    class FixedHome(SplitMeter):
        def __init__(self, home: int) -> None:
            super().__init__()
            self.calls = 0
            self.fixed = home

        def observe(self, snapshot: PoolSnapshot, now_s: float) -> PoolSnapshot:
            self.calls += 1
            return dataclasses.replace(snapshot, measured_home_rollout=self.fixed)

    w = load_workload_file(SMALL)
    elastic = ElasticPolicy(staleness_bound=w.staleness_bound, role_change_s=w.costs.elastic_role_change_s)
    one, most = FixedHome(1), FixedHome(w.num_units - 1)
    at_one, at_most = simulate(w, elastic, split_meter=one), simulate(w, elastic, split_meter=most)
    assert one.calls > 0 and most.calls > 0
    assert at_one.step_done_s != at_most.step_done_s
    assert at_one.step_done_s == simulate(w, elastic, split_meter=FixedHome(1)).step_done_s
