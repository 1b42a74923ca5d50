"""End to end: an unmodified agent written against the official `anthropic` client
(examples/byo_agent/anthropic_agent.py, nothing from Gyre, no URL rewriting) trains through the
external harness: `gyre run` with real NATS, Postgres, gRPC, the four service processes, the torch
engine and the Megatron trainer. The harness hands each launch ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY
(and ANTHROPIC_AUTH_TOKEN) of its own execution; the client appends `/v1/messages` itself.

Shows: every launch is one execution whose calls are call_seq 0..n-1; groups are scored and paths
trained; and every stored call (read back with `gyre trajectory export`) has as prompt ids exactly
the byte chat template of the conversation the agent sent (its transcript, put in chat form here by
hand: text blocks joined, tool_use -> tool_calls with the input as JSON, tool_result -> a tool
message).

The only addition to the example's configuration is the reward function, which scores with
examples/byo_agent/reward.py and copies the agent's transcript out of its working directory for
this test before the directory is removed. (Completion ids equal to what the engine produced are
shown by tests/rollout/test_tool_call_roundtrip.py; the agent does not keep them.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.job.eventlog import read_events
from gyre.tokenizers import load_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GYRE = [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())"]
STEPS = 2
MAX_TURNS = 4  # examples/byo_agent/agent.py
BYTE = load_tokenizer("byte")  # the run's tokenizer and chat template

REWARD = """
import importlib.util, shutil, uuid
from pathlib import Path

_spec = importlib.util.spec_from_file_location("byo_reward", {example!r})
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)


def score(task, workdir, output, exit_code):
    transcript = Path(workdir) / "transcript.jsonl"
    if transcript.is_file():
        shutil.copy(transcript, Path({out!r}) / f"{{uuid.uuid4().hex}}.jsonl")
    return _example.score(task, workdir, output, exit_code)
"""


def _chat_form(request: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(chat messages, chat tools) of an Anthropic request, written out by hand."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": request["system"]}]
    for m in request["messages"]:
        if isinstance(m["content"], str):
            messages.append({"role": m["role"], "content": m["content"]})
            continue
        if m["role"] == "assistant":
            text = "".join(b["text"] for b in m["content"] if b["type"] == "text")
            reasoning = "".join(b["thinking"] for b in m["content"] if b["type"] == "thinking")
            calls = [
                {
                    "id": b["id"],
                    "type": "function",
                    "function": {"name": b["name"], "arguments": json.dumps(b["input"])},
                }
                for b in m["content"]
                if b["type"] == "tool_use"
            ]
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
            continue
        for b in m["content"]:
            if b["type"] == "tool_result":
                messages.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": b["content"]})
            else:
                messages.append({"role": "user", "content": b["text"]})
    tools = [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
        }
        for t in request["tools"]
    ]
    return messages, tools


def test_unmodified_anthropic_client_agent_trains_and_its_calls_are_stored_as_the_chat_template(
    nats_url: str, database_url: str, tmp_path: Path
) -> None:
    transcripts = tmp_path / "transcripts"
    transcripts.mkdir()
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD.format(example=str(ROOT / "examples/byo_agent/reward.py"), out=str(transcripts)))
    config = yaml.safe_load((ROOT / "examples/byo_agent/config.yaml").read_text())
    config["rollout"]["harness"]["command"] = ["{python}", "examples/byo_agent/anthropic_agent.py"]
    config["rollout"]["harness"]["reward"] = f"{reward}:score"
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))

    run_dir = tmp_path / "byo-anthropic"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GYRE_", "ANTHROPIC_", "OPENAI_"))}
    run_id = f"byoa-{tmp_path.name}"[:60]
    env.update(GYRE_NATS_URL=nats_url, GYRE_DATABASE_URL=database_url, GYRE_RUN_ID=run_id)
    proc = subprocess.run(
        [*GYRE, "run", str(config_path), "--steps", str(STEPS), "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, f"gyre run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    records = read_events(run_dir / "events.jsonl")
    events: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        events.setdefault(r["type"], []).append(r["event"])
    ended = {e["execution_id"]: e for e in events["ExecutionEvent"] if e.get("kind") != "KIND_STARTED"}
    finished = [x for x, e in ended.items() if e.get("kind") == "KIND_FINISHED"]
    assert finished, ended  # the agent ran to its end: no call was refused
    for x in finished:
        assert int(ended[x]["num_calls"]) == MAX_TURNS, ended[x]
    trained_paths = sum(
        int(float(e.get("metrics", {}).get("num_paths", 0))) for e in events["WeightsPublishedEvent"]
    )
    assert trained_paths > 0 and events.get("GroupScoredEvent")

    # the agent's own record of each call, by the execution and call the response id names
    sent: dict[tuple[str, int], dict[str, Any]] = {}
    for path in transcripts.iterdir():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            execution, _, seq = entry["id"].removeprefix("msg_").rpartition("-")
            sent[(execution, int(seq))] = entry
    checked = 0
    for x in finished[:4]:
        out = subprocess.run(
            [*GYRE, "trajectory", "export", "--execution", x, "--config", str(run_dir / "config.yaml")],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        calls = json.loads(out.stdout)["calls"]
        assert sorted(c["call_seq"] for c in calls) == list(range(MAX_TURNS))
        for c in calls:
            entry = sent[(x, c["call_seq"])]
            messages, tools = _chat_form(entry["request"])
            assert c["prompt_token_ids"] == BYTE.apply_chat_template(messages, tools=tools), (
                x,
                c["call_seq"],
            )
            checked += 1
    print(
        f"{len(finished)} executions finished, {trained_paths} paths trained; {checked} stored calls equal the chat template"
    )
