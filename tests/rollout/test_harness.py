"""External harness mode: the user's agent as a process per execution, against the real OpenAI
endpoint, router, torch engine and NATS step stream (nothing of Gyre's is faked; the agent is the
unmodified examples/byo_agent/agent.py or a small script standing in for a misbehaving agent)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
import openai
import pytest

from gyre.bus import Bus, subjects
from gyre.model import ModelConfig
from gyre.v1 import events_pb2
from services.rollout.agent import ExecutionSpec
from services.rollout.agent_process import HarnessSettings
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.environments.json_tasks import JsonTaskFamily
from services.rollout.harness import ExternalHarness, OpenAIExecutions, load_reward
from services.rollout.openai import OpenAIEndpoint, create_app, serve
from services.rollout.router import Router
from services.rollout.steps import BusStepSink
from tests.helpers.stream import expanded_prompts

ROOT = Path(__file__).resolve().parents[2]
RUN = "harness-test"
API_KEY = "run-key-0123456789abcdef"
E = events_pb2.ExecutionEvent


class RecordingExecutions(OpenAIExecutions):
    """The real endpoint adapter; it also keeps what it issued so the test can try it afterwards."""

    def __init__(self, endpoint: OpenAIEndpoint) -> None:
        super().__init__(endpoint)
        self.issued: dict[str, tuple[str, str]] = {}

    def issue(self, spec: ExecutionSpec) -> tuple[str, str]:
        self.issued[spec.execution_id] = out = super().issue(spec)
        return out


@pytest.fixture
async def stack(nats_url: str):
    bus = await Bus.connect(nats_url, name="harness-test")
    await bus.ensure_streams()
    sink = BusStepSink(bus, max_buffer=256, batch_size=16)
    sink.start()
    router = Router()
    engine = TorchEngine("e0", "cpu0-0", ModelConfig.model_validate({}), init_seed=1)
    await engine.start()
    await router.add_engine(engine)
    endpoint = OpenAIEndpoint(router, sink, run_id=RUN, api_key=API_KEY)
    server, port = await serve(create_app(endpoint), "127.0.0.1", 0)
    yield bus, sink, endpoint, port
    server.should_exit = True
    await server.gyre_task
    for d in list(router.engines):
        await router.remove_engine(d)
    await sink.flush()
    await sink.close()
    await bus.close()


async def collect(bus: Bus, subject: str, msg_type, n: int) -> list:
    """The first n messages of `subject` (JetStream, from the start of the stream)."""
    out: list = []

    async def run() -> None:
        async for ev in bus.tail(subject, msg_type, from_start=True):
            out.append(ev)
            if len(out) == n:
                return

    await asyncio.wait_for(run(), 30)
    return out


def spec(task_id: str, group: str, k: int) -> ExecutionSpec:
    return ExecutionSpec(RUN, task_id, f"{task_id}-{group}", f"{task_id}-{group}-e{k}", "tasks")


async def test_the_unmodified_example_agent_makes_one_execution_per_launch_scored_and_closed(stack) -> None:
    bus, sink, endpoint, port = stack
    family = JsonTaskFamily.from_jsonl(ROOT / "examples/byo_agent/tasks.jsonl")
    executions = RecordingExecutions(endpoint)
    harness = ExternalHarness(
        executions,
        sink,
        HarnessSettings(command=["{python}", "examples/byo_agent/agent.py"], timeout_s=120),
        load_reward("examples/byo_agent/reward.py:score"),
    )
    specs = [spec("add-17-25", "g0", k) for k in range(3)]
    outcomes = await asyncio.gather(*(harness.run(s, family.make(s.task_id)) for s in specs))
    await sink.flush()

    steps: dict[str, list[events_pb2.StepEvent]] = {}
    for ev in await collect(bus, subjects.steps(RUN, "add-17-25"), events_pb2.StepEvent, 12):
        steps.setdefault(ev.execution_id, []).append(ev)
    ends: dict[str, events_pb2.ExecutionEvent] = {}
    for ev in await collect(bus, subjects.executions(RUN, "add-17-25"), events_pb2.ExecutionEvent, 6):
        if ev.kind != E.KIND_STARTED:
            ends[ev.execution_id] = ev

    for s, out in zip(specs, outcomes, strict=True):
        assert out.kind == E.KIND_FINISHED, out.error
        assert out.num_calls == 4  # the agent's MAX_TURNS, every call in this one execution
        calls = steps[s.execution_id]
        assert sorted(c.call_seq for c in calls) == [0, 1, 2, 3]
        assert {c.group_id for c in calls} == {"add-17-25-g0"}
        assert ends[s.execution_id].kind == E.KIND_FINISHED
        assert ends[s.execution_id].num_calls == 4
        assert ends[s.execution_id].progress.milestones_total == 3
        assert ends[s.execution_id].reward == pytest.approx(out.progress.score())
        # the agent windows its history: the last prompt does not extend the previous call
        by_seq = {c.call_seq: c for c in calls}
        prompts = expanded_prompts(calls)  # calls after the first travel compact: rebuilt here
        previous = prompts[2] + list(by_seq[2].completion_token_ids)
        assert prompts[3][: len(previous)] != previous
    assert set(steps) == {s.execution_id for s in specs}  # nothing landed anywhere else
    assert not endpoint.executions  # every issued execution was ended

    # a call made with an ended execution's URL or key is refused
    base_url, key = executions.issued[specs[0].execution_id]
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "late"}])
    by_key = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await by_key.chat.completions.create(model="m", messages=[{"role": "user", "content": "late"}])
    await client.close()
    await by_key.close()


async def test_anonymous_calls_are_refused_with_how_to_name_the_execution_and_open_nothing(stack) -> None:
    bus, sink, endpoint, port = stack
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
    for _ in range(3):
        with pytest.raises(openai.BadRequestError, match="X-Gyre-Execution-Id"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    await client.close()
    async with httpx.AsyncClient() as http:
        reply = await http.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert reply.status_code == 401  # no key at all
    assert not endpoint.executions  # none opened, so none left open


AGENT_THAT_HANGS = """
import subprocess, time
child = subprocess.Popen(["sleep", "300"])
print(child.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.slow
async def test_an_agent_past_its_timeout_is_killed_with_its_children_and_truncated(stack, tmp_path) -> None:
    bus, sink, endpoint, port = stack
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"task_id": "hang", "prompt": "wait"}\n')
    seen: list[tuple[str, int | None]] = []

    def reward(task, workdir, output, exit_code):
        seen.append((output, exit_code))
        return {"milestones_reached": 1, "milestones_total": 4}

    harness = ExternalHarness(
        OpenAIExecutions(endpoint),
        sink,
        HarnessSettings(command=[sys.executable, "-c", AGENT_THAT_HANGS], timeout_s=3, kill_grace_s=1),
        reward,
    )
    s = spec("hang", "g0", 0)
    out = await harness.run(s, JsonTaskFamily.from_jsonl(tasks).make("hang"))
    assert out.kind == E.KIND_TRUNCATED and "timed out" in out.error
    assert out.progress.milestones_reached == 1  # partial progress travels with the truncated execution
    output, exit_code = seen[0]
    assert exit_code is None  # the reward function is told it timed out
    child = int(output.split()[0])
    with pytest.raises(ProcessLookupError):  # reaped by its parent's group kill, or gone
        for _ in range(50):
            os.kill(child, 0)
            await asyncio.sleep(0.1)
    assert not endpoint.executions


async def test_a_failing_agent_fails_its_execution_with_its_stderr(stack, tmp_path) -> None:
    bus, sink, endpoint, port = stack
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"task_id": "boom", "prompt": "x"}\n')
    harness = ExternalHarness(
        OpenAIExecutions(endpoint),
        sink,
        HarnessSettings(command=[sys.executable, "-c", "import sys; sys.exit('no model for me')"]),
        lambda *a: 1.0,
    )
    out = await harness.run(spec("boom", "g0", 0), JsonTaskFamily.from_jsonl(tasks).make("boom"))
    assert out.kind == E.KIND_FAILED and "no model for me" in out.error
    assert not endpoint.executions


SOLVER = """
import json, sys, pathlib
task = json.load(sys.stdin)
assert "tests" not in task["task"] and "solution" not in task["task"], "hidden parts leaked"
pathlib.Path("textstats.py").write_text({source!r})
"""
FULL = "def word_count(t):\n    return len(t.split())\n\n\ndef char_histogram(t):\n    out = {}\n    for c in t:\n        if not c.isspace():\n            out[c] = out.get(c, 0) + 1\n    return out\n"
HALF = "def word_count(t):\n    return len(t.split())\n\n\ndef char_histogram(t):\n    return {}\n"


@pytest.mark.parametrize("source,fraction", [(FULL, 1.0), (HALF, 0.5)])
async def test_without_a_reward_function_the_workspace_tests_score_the_files_the_agent_left(
    stack, tmp_path, source, fraction
) -> None:
    from services.rollout.environments.workspace import WorkspaceFamily

    bus, sink, endpoint, port = stack
    family = WorkspaceFamily.from_jsonl(ROOT / "examples/tasks/workspace.jsonl")
    solver = [sys.executable, "-c", SOLVER.format(source=source)]
    harness = ExternalHarness(OpenAIExecutions(endpoint), sink, HarnessSettings(command=solver))
    out = await harness.run(spec("ws-textstats", "g0", 0), family.make("ws-textstats"))
    assert out.kind == E.KIND_FINISHED, out.error
    assert out.reward == fraction and out.progress.tests_passed_fraction == fraction


def test_config_refuses_an_external_harness_it_cannot_run() -> None:
    from pydantic import ValidationError

    from services.rollout.config import RolloutConfig

    def external(**harness: object) -> dict[str, object]:
        return {"kind": "external", **harness}

    with pytest.raises(ValidationError, match="harness.command"):
        RolloutConfig(harness=external(), environment="workspace")
    with pytest.raises(ValidationError, match="harness.tasks"):
        RolloutConfig(harness=external(command=["agent"]))  # longhorizon has no external tasks
    with pytest.raises(ValidationError, match="harness.reward"):
        RolloutConfig(harness=external(command=["agent"], tasks=Path("t.jsonl")))
    with pytest.raises(ValidationError, match=r"openai\.port"):
        RolloutConfig(harness=external(command=["a"]), environment="workspace", openai={"port": None})
    cfg = RolloutConfig(harness=external(command=["a"], timeout_s=7), environment="workspace")
    assert cfg.harness.kind == "external" and cfg.harness.timeout_s == 7.0


def test_the_old_flat_harness_keys_are_refused_naming_the_nested_key() -> None:
    from pydantic import ValidationError

    from gyre.config import load_section
    from gyre.errors import ConfigError
    from services.rollout.config import RolloutConfig

    with pytest.raises(
        ValidationError, match=r"rollout\.harness_timeout_s is now rollout\.harness\.timeout_s"
    ):
        RolloutConfig.model_validate({"harness_timeout_s": 120})
    with pytest.raises(
        ValidationError, match=r"rollout\.harness: external is now rollout\.harness\.kind: external"
    ):
        RolloutConfig.model_validate({"harness": "external", "harness_command": ["agent"]})
    with pytest.raises(ValidationError, match=r"harness_command is now rollout\.harness\.command"):
        RolloutConfig.model_validate({"harness": "external", "harness_command": ["agent"]})
    with pytest.raises(ConfigError, match=r"rollout\.harness_cpu_s is now rollout\.harness\.cpu_s"):
        load_section(RolloutConfig, "rollout", data={"rollout": {"harness_cpu_s": 5}})


def test_the_byo_agent_example_config_loads_with_the_nested_harness_section() -> None:
    from gyre.config import load_section
    from services.rollout.config import RolloutConfig

    cfg = load_section(RolloutConfig, "rollout", ROOT / "examples/byo_agent/config.yaml")
    assert cfg.harness.kind == "external"
    assert cfg.harness.command[-1] == "examples/byo_agent/agent.py"
    assert cfg.harness.timeout_s == 120.0


def test_bad_reward_paths_and_values_are_clear_errors(tmp_path) -> None:
    from gyre.errors import InvalidArgument
    from services.rollout.harness import _as_progress

    with pytest.raises(InvalidArgument, match="no callable 'nope'"):
        load_reward("examples/byo_agent/reward.py:nope")
    with pytest.raises(InvalidArgument, match="cannot import"):
        load_reward("no_such_module_xyz:score")
    with pytest.raises(InvalidArgument, match="no file"):
        load_reward(str(tmp_path / "missing.py") + ":score")
    with pytest.raises(InvalidArgument, match="non-finite"):
        _as_progress(float("nan"))
    with pytest.raises(InvalidArgument, match="expected a number or a dict"):
        _as_progress("1.0")
    reward, progress = _as_progress({"milestones_reached": 1, "milestones_total": 4})
    assert reward == 0.25 and progress.milestones_total == 4
    with pytest.raises(InvalidArgument, match="does not exist"):
        JsonTaskFamily.from_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(InvalidArgument, match="not an executable"):
        ExternalHarness(None, None, HarnessSettings(command=["no-such-agent-xyz"]))  # type: ignore[arg-type]
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"task_id": "a b", "prompt": "x"}\n')
    with pytest.raises(InvalidArgument, match="tasks.jsonl:1"):
        JsonTaskFamily.from_jsonl(bad)
