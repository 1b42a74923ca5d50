"""`gyre chaos --soak`: the seeded kill plan, the continuity of the weight versions, and a short real
soak (every service its own supervised process, embedded NATS and Postgres) that loses nothing.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from app.chaos_soak import SERVICES, plan_soak, soak_config, version_history
from gyre.errors import ConfigError
from tests.ops.test_chaos import run_chaos


def test_a_soak_plan_is_seeded_and_holds_a_close_pair_and_a_kill_of_a_restarting_service() -> None:
    kills = plan_soak(50, random.Random(3))
    assert [(k.target, k.how, k.delay_s) for k in kills] == [
        (k.target, k.how, k.delay_s) for k in plan_soak(50, random.Random(3))
    ]
    assert len(kills) == 50 and len({k.target for k in kills}) >= 6
    (close,) = [i for i, k in enumerate(kills) if k.how == "close"]
    assert kills[close].delay_s < 1.0 and kills[close].target != kills[close - 1].target
    (again,) = [i for i, k in enumerate(kills) if k.how == "recovering"]
    assert kills[again].target == kills[again - 1].target and kills[again].target in SERVICES
    assert abs(again - close) >= 2  # two distinct situations
    others = [k for k in kills if k.how not in ("close", "recovering")]
    assert all(0.5 <= k.delay_s <= 8.0 for k in others)
    assert all(k.target == "trainer" for k in kills if k.how in ("pull", "publish"))


def test_a_soak_needs_room_for_its_two_aimed_kills() -> None:
    with pytest.raises(ConfigError):
        plan_soak(3, random.Random(0))
    assert len(plan_soak(4, random.Random(0))) == 4


def test_a_soak_raises_the_restart_budget_above_its_kills_and_sizes_the_run_to_them() -> None:
    raw = soak_config({"job": {"num_steps": 20}, "launcher": {"max_restarts": 5}}, 50, steps=None)
    assert raw["launcher"]["max_restarts"] == 55
    assert raw["job"]["num_steps"] == 50
    assert raw["rollout"]["fault_injection"] is True
    with pytest.raises(ConfigError):
        soak_config({"launcher": {"nats_cluster_size": 3}}, 10, steps=None)


def _weights(version: int, at: float, sha: str = "") -> dict:
    weights = {"version": version, "created_unix_s": at, "sha256": sha or f"s{version}"}
    return {"type": "WeightsPublishedEvent", "event": {"weights": weights}}


def _history(tmp_path: Path, records: list[dict], num_steps: int = 3) -> dict:
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return version_history(path, num_steps, stall_s=100.0, started=0.0)


def test_versions_are_continuous_when_each_of_1_to_n_is_published_in_order(tmp_path: Path) -> None:
    ok = _history(tmp_path, [_weights(1, 10), _weights(2, 20), _weights(3, 250)])
    assert ok["steps_continuous"] is True
    assert ok["longest_version_gap_s"] == 230 and ok["longest_version_gap_after"] == 2
    assert ok["version_gaps_over_stall"] == 1
    same = _history(tmp_path, [_weights(1, 10), _weights(2, 20), _weights(2, 21), _weights(3, 30)])
    assert same["steps_continuous"] is True and same["versions_republished"] == 1  # identical bytes
    assert _history(tmp_path, [_weights(1, 10), _weights(3, 20)])["steps_continuous"] is False  # a hole
    swapped = _history(tmp_path, [_weights(1, 10), _weights(2, 30), _weights(3, 20)])
    assert swapped["steps_continuous"] is False  # out of order
    other = [_weights(1, 10), _weights(2, 20), _weights(2, 21, "x"), _weights(3, 30)]
    assert _history(tmp_path, other)["steps_continuous"] is False  # one version, two weights
    assert _history(tmp_path, [_weights(1, 10)])["steps_continuous"] is False  # short of its steps


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(2000)
def test_a_short_soak_of_random_kills_restarts_every_target_hit_and_loses_nothing(tmp_path: Path) -> None:
    proc = run_chaos(
        ["examples/quickstart.yaml", "--json", "--soak", "--kills", "6", "--steps", "8", "--seed", "1"]
        + ["--run-dir", str(tmp_path / "run")],
        tmp_path,
        timeout_s=1900,
    )
    assert proc.stdout.strip(), proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["kills_made"] == 6, result["kill_errors"]
    # every kill of a process was followed by the supervisor's restart of it (an engine kill by one
    # more engine restart of the rollout), and the run's restarts count at least the kills made
    assert result["kills_confirmed"] == 6, result["kills"]
    for target, num in result["kills_per_target"].items():
        if target != "engine":
            assert result["restarts_per_target"].get(target, 0) >= num, (
                target,
                result["restarts_per_target"],
            )
    assert len(result["close_kills_s"]) == 1
    assert result["recovering_kill_hit"] in ([True], [False])
    assert result["completed"] is True and result["stalls"] == 0, result["end_reason"]
    assert result["steps_continuous"] is True
    for counter in ("steps_lost", "paths_trained_twice", "batches_lost", "double_leases", "executions_lost"):
        assert result[counter] == 0, (counter, result.get("executions_lost_fates"), result)
    assert result["engine_kill_executions_lost"] == 0
    assert result["trainer_bitwise_equal"] is True
    assert result["ok"] is True
