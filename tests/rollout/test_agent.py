"""Agent loop and context management. The tiny model runs for real (torch engine behind the router);
the reasoning test uses a SCRIPTED generator (a fake model at the outermost edge, said here) because
an untrained model never emits <think> spans."""

from gyre import tokenizer as tok
from gyre.model import ModelConfig
from gyre.v1 import events_pb2
from services.rollout.agent import Agent, AgentConfig, ExecutionSpec
from services.rollout.engines.base import Completion, GenerationRequest
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.environments.longhorizon import LongHorizonFamily, LongHorizonSpec
from services.rollout.router import Router
from services.rollout.steps import MemoryStepSink

FAMILY = LongHorizonFamily(LongHorizonSpec(min_turns=12, max_turns=16))


def spec(task_id: str, n: int = 0) -> ExecutionSpec:
    return ExecutionSpec("r", task_id, f"{task_id}-g0", f"{task_id}-g0-e{n}", "longhorizon", seed=1)


async def run_with_model(context: str) -> MemoryStepSink:
    router = Router()
    await router.add_engine(TorchEngine("e0", "cpu0-0", ModelConfig.model_validate({}), init_seed=1))
    await router.engines["cpu0-0"].start()
    sink = MemoryStepSink()
    agent = Agent(router, sink, AgentConfig(max_tokens=2, temperature=1.0, context=context, compact_every=4))  # type: ignore[arg-type]
    out = await agent.run(spec("lh-00002"), FAMILY.make("lh-00002"))
    await router.remove_engine("cpu0-0")
    assert out.num_calls == len(sink.steps) == sink.executions[-1].num_calls
    return sink


async def test_execution_publishes_started_steps_and_an_end_event_with_extending_prompts() -> None:
    sink = await run_with_model("none")
    kinds = [e.kind for e in sink.executions]
    assert kinds[0] == events_pb2.ExecutionEvent.KIND_STARTED
    assert kinds[-1] in {events_pb2.ExecutionEvent.KIND_FINISHED, events_pb2.ExecutionEvent.KIND_TRUNCATED}
    for a, b in zip(sink.steps, sink.steps[1:], strict=False):
        before = list(a.prompt_token_ids) + list(a.completion_token_ids)
        assert list(b.prompt_token_ids[: len(before)]) == before and b.context_event == ""
    assert all(len(s.completion_versions) == len(s.completion_token_ids) == 2 for s in sink.steps)
    assert [s.call_seq for s in sink.steps] == list(range(len(sink.steps)))


async def test_compaction_replaces_old_turns_and_breaks_the_prefix() -> None:
    sink = await run_with_model("compaction")
    events = [s.context_event for s in sink.steps]
    assert events[4] == "compaction" and events[3] == "" and events[5] == ""
    p2, p3, p4 = (list(sink.steps[i].prompt_token_ids) for i in (2, 3, 4))
    assert "[summary] 2 earlier turns" in tok.decode(p4)
    kept = p3[len(p2) - 1 :]  # turn 2 as it was shown, up to turn 3's assistant marker
    assert any(p4[i : i + len(kept)] == kept for i in range(len(p4)))


class ScriptedReasoner:
    """Fake model: always answers '<think>hmm</think>A<eos>'."""

    async def generate(self, request: GenerationRequest) -> Completion:
        ids = [tok.THINK_OPEN, *tok.encode("hmm"), tok.THINK_CLOSE, ord("A"), tok.EOS]
        return Completion(ids, [0.0] * len(ids), [0] * len(ids), "stop", ["scripted"])


async def test_stripping_reasoning_removes_earlier_think_spans_from_prompts() -> None:
    sink = MemoryStepSink()
    agent = Agent(ScriptedReasoner(), sink, AgentConfig(context="strip_reasoning", max_calls=3))
    await agent.run(spec("lh-00002"), FAMILY.make("lh-00002"))
    second = list(sink.steps[1].prompt_token_ids)
    assert tok.THINK_OPEN not in second and sink.steps[1].context_event == "strip_reasoning"
