"""End to end: `gyre run examples/byo_agent/config.yaml` — the unmodified example agent (official
`openai` client, nothing from Gyre) launched by the rollout service once per execution, with real
NATS, Postgres, gRPC, the four service processes, the torch engine and the Megatron trainer.

Shows: every launch is one execution whose calls are call_seq 0..n-1 of that execution only; the
agent's windowed history branches; every group whose executions all ended before the last trainer
step is scored; paths are trained; and `gyre trajectory export` returns every call token-exact
(prompt and completion ids, versions; log-probs to float32 precision) against the step events.
NATS and Postgres are the test session's servers (so the database outlives the run for export).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.job.eventlog import read_events
from gyre.bus import subjects
from gyre.v1 import events_pb2
from tests.helpers.stream import expanded_prompts, read_stream

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GYRE = [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())"]
STEPS = 2
MAX_TURNS = 4  # examples/byo_agent/agent.py


def test_unmodified_agent_runs_one_execution_per_launch_scored_trained_and_exported_exactly(
    nats_url: str, database_url: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "byo"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    run_id = f"byo-{tmp_path.name}"[:60]
    env.update(GYRE_NATS_URL=nats_url, GYRE_DATABASE_URL=database_url, GYRE_RUN_ID=run_id)
    proc = subprocess.run(
        [*GYRE, "run", "examples/byo_agent/config.yaml", "--steps", str(STEPS), "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, f"gyre run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    records = read_events(run_dir / "events.jsonl")
    events: dict[str, list[dict]] = {}
    for r in records:
        events.setdefault(r["type"], []).append(r["event"])
    launched = {e["execution_id"] for e in events["ExecutionEvent"] if e.get("kind") == "KIND_STARTED"}
    ended = {e["execution_id"]: e for e in events["ExecutionEvent"] if e.get("kind") != "KIND_STARTED"}
    # the step events in full (events.jsonl keeps summaries), replayed from the run's NATS stream
    steps = read_stream(nats_url, subjects.steps(run_id, "*"), events_pb2.StepEvent, len(events["StepEvent"]))
    calls: dict[str, list[events_pb2.StepEvent]] = {}
    for step in steps:
        calls.setdefault(step.execution_id, []).append(step)

    # one execution per launch: every call belongs to a launched execution, in its own group
    assert launched and set(calls) <= launched
    finished = [x for x, e in ended.items() if e.get("kind") == "KIND_FINISHED"]
    assert finished, ended
    for x in finished:
        seqs = sorted(c.call_seq for c in calls[x])
        assert seqs == list(range(int(ended[x]["num_calls"]))) == list(range(MAX_TURNS)), (x, seqs)
        assert {c.group_id for c in calls[x]} == {ended[x]["group_id"]}
        # the agent windows its history: its last prompt does not extend the previous call
        by_seq = {c.call_seq: c for c in calls[x]}
        prompts = expanded_prompts(calls[x])  # calls after the first travel compact: rebuilt here
        previous = prompts[2] + list(by_seq[2].completion_token_ids)
        assert prompts[3][: len(previous)] != previous

    # the trees: one execution per launch, every call stored, and the agent's windowed history
    # (and the group's different answers) split nodes, so there are more nodes than calls
    stats = json.loads((run_dir / "final_stats.json").read_text())["trajectory"]["values"]
    assert int(stats["executions"]) == len(launched)
    assert int(stats["stored_calls"]) == len(steps)
    assert int(stats["stored_nodes"]) > int(stats["stored_calls"]), stats

    # every group that ended before the last trainer step is scored; paths were trained
    group_size = 4
    last_weights = max(r["recv_unix_s"] for r in records if r["type"] == "WeightsPublishedEvent")
    done_at: dict[str, list[float]] = {}
    for r in records:
        if r["type"] == "ExecutionEvent" and r["event"].get("kind") != "KIND_STARTED":
            done_at.setdefault(r["event"]["group_id"], []).append(r["recv_unix_s"])
    complete = {g for g, ts in done_at.items() if len(ts) == group_size and max(ts) < last_weights}
    scored = {e["group_id"] for e in events.get("GroupScoredEvent", [])}
    assert complete and complete <= scored, (complete, scored)
    trained_paths = sum(
        int(float(e.get("metrics", {}).get("num_paths", 0))) for e in events["WeightsPublishedEvent"]
    )
    scored_paths = sum(int(e.get("num_paths", 0)) for e in events["GroupScoredEvent"])
    assert 0 < trained_paths <= scored_paths

    print(
        f"launched {len(launched)} executions, {len(finished)} finished with {MAX_TURNS} calls each; "
        f"{len(steps)} calls, {int(stats['stored_nodes'])} tree nodes; groups complete {len(complete)}, "
        f"scored {len(scored)}; paths trained {trained_paths} of {scored_paths} scored"
    )

    # token-exact in `gyre trajectory export` (read straight from the run's Postgres)
    import numpy as np

    for x in finished[:3]:
        out = subprocess.run(
            [*GYRE, "trajectory", "export", "--execution", x, "--config", str(run_dir / "config.yaml")],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        exported = {c["call_seq"]: c for c in json.loads(out.stdout)["calls"]}
        assert sorted(exported) == list(range(MAX_TURNS))
        prompts = expanded_prompts(calls[x])
        for step in calls[x]:
            c = exported[step.call_seq]
            assert c["prompt_token_ids"] == prompts[step.call_seq]
            assert c["completion_token_ids"] == list(step.completion_token_ids)
            assert c["completion_versions"] == list(step.completion_versions)
            np.testing.assert_array_equal(
                np.float32(c["completion_logprobs"]), np.float32(list(step.completion_logprobs))
            )
        print(f"export {x}: {len(exported)} calls token-exact")
