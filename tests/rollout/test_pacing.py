"""Paced devices (gyre/pacing.py): a paced device requests the cost model's time; pacing off requests
nothing. Asserts the modelled durations and the waits requested, never wall-clock timing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gyre.config import load_common
from gyre.errors import ConfigError
from gyre.model import ModelConfig
from gyre.pacing import ModeledTurn, Pacer, PacingConfig
from gyre.workload import load_workload_file, sample_executions
from services.rollout.agent import AgentConfig, Conversation
from services.rollout.engines.base import GenerationRequest, Sampling
from services.rollout.engines.torch_engine import TorchEngine
from services.rollout.environments.base import Action
from services.rollout.environments.workload_plans import WorkloadEnv, WorkloadFamily, target_hit

SMALL = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "small.yaml"


class FakeClock:
    """A monotonic clock that moves only when told (the outermost edge: time itself)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.slept.append(s)


def paced(time_scale: float = 100.0, **kw: object) -> PacingConfig:
    return PacingConfig.model_validate(
        {"enabled": True, "workload_file": str(SMALL), "time_scale": time_scale, **kw}
    )


async def test_paced_wait_is_the_cost_model_time_over_time_scale_minus_the_work_done() -> None:
    clock = FakeClock()
    pacer = Pacer(paced(10.0), clock=clock, sleep=clock.sleep)
    cost = load_workload_file(SMALL).cost_model()
    turn = ModeledTurn(context_tokens=10_000, new_tokens=500, gen_tokens=2_000)
    modeled = pacer.generation_s(turn, decoding_context=30_000)
    expected = cost.prefill_s(500, 10_000) + 2_000 * cost.decode_step_s(30_000 + 10_500)
    assert modeled == pytest.approx(expected, rel=1e-12)
    started = clock.now
    clock.now += 0.25  # the real computation took 0.25 s
    wall = await pacer.wait("generate", started, modeled)
    assert modeled / 10.0 > 0.25
    assert wall == pytest.approx(modeled / 10.0 - 0.25)
    assert clock.slept == [pytest.approx(modeled / 10.0 - 0.25)]
    assert pacer.waits[-1].modeled_s == modeled
    # work that took longer than the modelled interval: no sleep at all
    assert await pacer.wait("generate", clock.now - 10.0, 1.0) == 0.0
    assert len(clock.slept) == 1
    # resumed after a migration: the KV copy instead of the prefill, the remaining share generated
    resumed = pacer.turn_of("", 0, 0, 0)  # no turn known: real counts x tokens_per_live_token
    assert resumed == ModeledTurn(0, 0, 0)
    pacer.turns["x"] = turn
    rest = pacer.turn_of("x", prompt_tokens=99, max_tokens=6, token_offset=2)
    assert rest.gen_tokens == pytest.approx(1_500) and rest.new_tokens == 0
    assert pacer.generation_s(rest, 0, resumed=True) == pytest.approx(
        cost.migration_s(rest.context_tokens) + 1_500 * cost.decode_step_s(rest.context_tokens)
    )


def test_training_role_changes_and_weight_sync_are_priced_as_the_simulator_does() -> None:
    w = load_workload_file(SMALL)
    cost = w.cost_model()
    pacer = Pacer(paced())
    plans = [e for step in sample_executions(w) for e in step]
    mean_flops = sum(cost.train_flops(e.final_context) for e in plans) / len(plans)
    assert pacer.train_s(3, 2) == pytest.approx(
        3 * w.group_size * mean_flops / cost.train_flops_per_s(2 * w.devices_per_unit)
    )
    assert pacer.role_change_s("train") == w.costs.elastic_role_change_s
    assert pacer.weight_sync_s() == w.costs.weight_sync_s
    colocate = Pacer(paced(switch_costs="whole_pool"))
    assert colocate.role_change_s("train") == w.costs.switch_rollout_to_train_s
    assert colocate.role_change_s("rollout") == w.costs.switch_train_to_rollout_s
    assert colocate.weight_sync_s() == 0.0


async def test_pacing_off_requests_no_wait_and_computes_nothing() -> None:
    clock = FakeClock()
    pacer = Pacer(clock=clock, sleep=clock.sleep)
    assert not pacer.enabled

    def never() -> float:
        raise AssertionError("no duration is computed when pacing is off")

    assert await pacer.wait("train", clock.now, never) == 0.0
    assert clock.slept == [] and list(pacer.waits) == []


def test_pacing_config_is_typed_and_needs_a_workload_file() -> None:
    with pytest.raises(ConfigError, match="workload_file"):
        load_common(data={"devices": {"pacing": {"enabled": True}}})
    with pytest.raises(ConfigError, match="time_scale"):
        load_common(data={"devices": {"pacing": {"time_scale": 0}}})
    assert load_common(data={}).devices.pacing.enabled is False


def _request(i: int, execution_id: str, max_tokens: int = 6) -> GenerationRequest:
    prompt = [257, *((i * 37 + k * 11) % 250 for k in range(6)), 261]
    sampling = Sampling(temperature=0.0, max_tokens=max_tokens, seed=i, stop_token_ids=())
    return GenerationRequest(f"r{i}", prompt, sampling, execution_id=execution_id)


async def test_a_paced_engine_requests_each_turn_at_the_engines_decoding_context() -> None:
    # time_scale 1e9: the requested waits are nanoseconds; the test reads what was requested
    pacer = Pacer(paced(1e9))
    turns = {f"x{i}": ModeledTurn(1_000.0 * i, 300.0, 800.0 + i) for i in range(3)}
    pacer.turns.update(turns)
    engine = TorchEngine("e0", "cpu0-0", ModelConfig.model_validate({}), init_seed=3, pacer=pacer)
    await engine.start()
    try:
        outs = await asyncio.gather(*(engine.generate(_request(i, f"x{i}")) for i in range(3)))
    finally:
        await engine.close()
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in outs)
    got = [w.modeled_s for w in pacer.waits if w.what == "generate"]
    # admitted together: each is priced with the modelled context of those admitted before it
    decoding, expected = 0.0, []
    for i in range(3):
        t = turns[f"x{i}"]
        expected.append(pacer.generation_s(t, decoding))
        decoding += t.context_tokens + t.new_tokens
    assert got == pytest.approx(expected, rel=1e-12)

    unpaced = Pacer()
    engine = TorchEngine("e1", "cpu0-1", ModelConfig.model_validate({}), init_seed=3, pacer=unpaced)
    await engine.start()
    try:
        plain = await asyncio.gather(*(engine.generate(_request(i, f"x{i}")) for i in range(3)))
    finally:
        await engine.close()
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs]  # pacing changes no token
    assert list(unpaced.waits) == []


async def test_workload_environment_follows_the_simulators_plans_and_tells_the_pacer() -> None:
    w = load_workload_file(SMALL)
    pacer = Pacer(paced(1e9))
    family = WorkloadFamily(w, pacer, time_scale=1e9)
    plans = sample_executions(w)
    env = family.make("wl-00002")

    # the rollout's 6th group (admission ordinal 5), whatever its task: step 5 // 4 = 1, task 5 % 4 = 1
    async def run() -> tuple[int, float | None]:
        opening = await env.reset()
        assert opening and env.plan == plans[1][1 * w.group_size + 3]
        assert pacer.turns["wl-00002-g5-e3"] == ModeledTurn(0.0, env.plan.obs[0], env.plan.gen[0])
        ctx, turns = 0.0, 0
        while True:
            turn = env.turn
            result = await env.step(Action.from_ids([2 if turn % 2 else 3, 9]))
            turns += 1
            ctx += env.plan.obs[turn] + env.plan.gen[turn]
            if result.done:
                assert "wl-00002-g5-e3" not in pacer.turns
                return turns, result.reward
            assert pacer.turns["wl-00002-g5-e3"] == ModeledTurn(
                ctx, env.plan.obs[turn + 1], env.plan.gen[turn + 1]
            )

    turns, reward = await asyncio.create_task(run(), name="wl-00002-g5-e3")
    assert env.plan is not None and turns == len(env.plan.gen)
    assert reward == pytest.approx(sum(target_hit([2 if t % 2 else 3]) for t in range(turns)) / turns)


async def test_every_workload_execution_has_the_same_real_tokens_so_a_batch_budget_counts_groups() -> None:
    w = load_workload_file(SMALL)
    family = WorkloadFamily(w, Pacer(paced(1e9)), time_scale=1e9, tokens_per_call=2)
    lengths = set()

    async def run(env: WorkloadEnv) -> int:
        conv = Conversation(AgentConfig(max_tokens=2))
        conv.add_opening(await env.reset())
        while True:
            prompt, completion = conv.prompt(), [7, 9]
            result = await env.step(Action.from_ids(completion))
            if result.done:
                return len(prompt) + len(completion)
            conv.add_turn(completion, result.messages)

    for name in ("wl-00000-g0-e0", "wl-00001-g2-e1", "wl-00003-g4-e2"):
        env = family.make(name.rsplit("-g", 1)[0])
        lengths.add(await asyncio.create_task(run(env), name=name))
        assert env.plan is not None
    assert lengths == {family.tokens_per_execution}


async def test_a_paced_engine_drained_mid_turn_keeps_the_modelled_share_and_the_call_resumes_exactly() -> (
    None
):
    from services.rollout.router import Router

    cfg = ModelConfig.model_validate({})
    turn = ModeledTurn(5_000.0, 400.0, 1_200.0)
    reference = TorchEngine("ref", "cpu9-0", cfg, init_seed=3)
    await reference.start()
    expected = await reference.generate(_request(1, "x1", max_tokens=8))
    await reference.close()

    clock = FakeClock()  # frozen: the paced engine holds the finished tokens until told otherwise
    held = Pacer(paced(10.0), clock=clock, sleep=clock.sleep)
    resumed = Pacer(paced(1e9))
    for p in (held, resumed):
        p.turns["x1"] = turn
    router = Router()
    engine_a = TorchEngine("a", "cpu0-0", cfg, init_seed=3, pacer=held)
    await engine_a.start()
    await router.add_engine(engine_a)
    call = asyncio.create_task(router.generate(_request(1, "x1", max_tokens=8)))
    while engine_a.tokens_generated < 8:  # noqa: ASYNC110 - polling a counter
        await asyncio.sleep(0.005)
    (wait,) = [w for w in held.waits if w.what == "generate"]
    clock.now += 0.5 * wait.modeled_s / 10.0  # half of the modelled turn has passed
    engine_b = TorchEngine("b", "cpu0-1", cfg, init_seed=3, pacer=resumed)
    await engine_b.start()
    await router.add_engine(engine_b)
    await router.remove_engine("cpu0-0")  # drained: cut at the modelled half, resumed on b
    got = await call
    await router.remove_engine("cpu0-1")

    assert got.token_ids == expected.token_ids and got.num_migrations == 1
    assert got.engine_ids == ["a", "b"]
    # b priced the rest as the simulator prices a migrated turn: the KV copy, then the remaining half
    rest = resumed.turn_of("x1", prompt_tokens=0, max_tokens=4, token_offset=4)
    (priced,) = [w.modeled_s for w in resumed.waits if w.what == "generate"]
    assert priced == pytest.approx(resumed.generation_s(rest, 0.0, resumed=True), rel=1e-12)
