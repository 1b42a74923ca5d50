"""`workload`: executions shaped by a workload file, for timing (paced devices), not for learning a skill.

The workload file is the one `gyre sim --workload-file` reads (gyre/workload.py): each execution
follows one `ExecutionPlan` of the simulator's seeded sampler (`sample_executions`): its number of
turns, each turn's modelled observation and generated tokens, and the tool latency after each turn.
The rollout numbers this family's groups in admission order (`group_number`: group `wl-<i>-g<n>`
is the n-th group the rollout process started, whatever its task), and execution `e<k>` of group n
follows the plan of simulated step `(n // tasks_per_step) mod num_steps`, task
`n mod tasks_per_step`, sample `k mod group_size`: the live run starts the simulator's batches in
the simulator's order. (Numbered per task instead, a task whose groups end early ran ahead of the
others through the steps and wrapped around to the first, shortest plans of a drifting workload,
and the live run trained a shorter mix than the simulated one: docs/scheduler.md.) The plan is a
function of the execution id, so a resumed execution replays the plan it started. The execution
learns its id from the asyncio task that runs it (the rollout names each execution's task by its
execution id, services/rollout/executions.py); under any other driver it takes plans in start
order.

Each turn the environment tells the pacer (gyre/pacing.py) the turn's modelled tokens (context so
far, observation, generated), so a paced engine takes as long as the modelled accelerator would;
the real observation is an empty user message and the real completion is `tokens_per_call`
(`rollout.max_tokens`) tokens. After each turn but the last the environment waits its tool latency
/ `time_scale` (asyncio sleep).

Every execution has the same number of real tokens (`live_tokens_per_execution`): the opening
message is padded (with a letter per group and member, so executions of a task share no padding), so the
trajectory service's token budget of a batch is a number of groups, as a simulated step is
(assuming each call generates exactly `tokens_per_call` tokens without the end token).

Reward (documented, honest, learnable, and beside the point): the share of turns whose first
generated token is even. A random policy gets about 0.5; a policy can learn to reach 1.0. Progress:
milestones = turns done of the plan's turns, so a truncated execution still carries a signal.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from typing import Any

from gyre import tokenizer
from gyre.errors import InvalidArgument
from gyre.pacing import ModeledTurn, Pacer
from gyre.workload import ExecutionPlan, Workload, sample_executions

from .base import Action, Environment, Progress, StepResult, TaskFamily

_TASK_RE = re.compile(r"^wl-(\d+)$")
_EXECUTION_RE = re.compile(r"^wl-(\d+)-(?:r\d+)?g(\d+)-e(\d+)$")


def _natural_tokens(turns: int, tokens_per_call: int) -> int:
    """Real tokens of an execution of `turns` calls with an empty opening and empty observations: BOS,
    the opening message, per earlier call its completion framed (assistant marker, end token) and an
    empty observation, the last prompt's assistant marker and the last completion."""
    opening = len(tokenizer.message_ids({"role": "user", "content": ""}))
    observation = len(tokenizer.message_ids({"role": "user", "content": ""}))
    return 1 + opening + (turns - 1) * (tokens_per_call + 2 + observation) + 1 + tokens_per_call


def live_tokens_per_execution(workload: Workload, tokens_per_call: int) -> int:
    """Real tokens of every execution of the workload (its longest plan's, plus one padding token)."""
    longest = max(len(e.gen) for step in sample_executions(workload) for e in step)
    return _natural_tokens(longest, tokens_per_call) + 1


def target_hit(token_ids: list[int]) -> bool:
    """The rewarded choice: the turn's first generated token is even (nothing generated: a miss)."""
    return bool(token_ids) and token_ids[0] % 2 == 0


class WorkloadEnv(Environment):
    name = "workload"
    resumable = True  # plan fixed by the execution id; replay skips the modelled tool latency

    def __init__(self, family: WorkloadFamily, task_id: str, task_index: int) -> None:
        self.family, self.task_id, self.task_index = family, task_id, task_index
        self.plan: ExecutionPlan | None = None
        self.execution_id = ""
        self.turn = 0  # turns completed
        self.context = 0.0  # modelled tokens in the context after the completed turns
        self.hits = 0

    @property
    def num_turns(self) -> int:
        return len(self.plan.gen) if self.plan is not None else 0

    def _announce(self) -> None:
        """Tell the pacer the modelled tokens of the next call (before the agent makes it)."""
        assert self.plan is not None
        ctx_before = self.context
        obs, gen = self.plan.obs[self.turn], self.plan.gen[self.turn]
        if self.execution_id:
            self.family.pacer.turns[self.execution_id] = ModeledTurn(ctx_before, obs, gen)

    def _message(self) -> dict[str, Any]:
        return {"role": "user", "content": ""}

    async def reset(self) -> list[dict[str, Any]]:
        task = asyncio.current_task()
        self.execution_id = task.get_name() if task is not None else ""
        self.plan, ordinal = self.family.plan_for(self.task_index, self.execution_id)
        self.turn, self.context, self.hits = 0, 0.0, 0
        self._announce()
        f = self.family
        pad = f.tokens_per_execution - _natural_tokens(self.num_turns, f.tokens_per_call)
        return [{"role": "user", "content": chr(ord("a") + ordinal % 26) * max(1, pad)}]

    @property
    def progress(self) -> Progress:
        return Progress(
            milestones_reached=self.turn,
            milestones_total=max(1, self.num_turns),
            extra={"turns": float(self.turn), "modeled_context_tokens": self.context},
        )

    async def step(self, action: Action, *, wait: bool = True) -> StepResult:
        if self.plan is None:
            raise RuntimeError("workload environment: step() before reset()")
        self.hits += target_hit(action.token_ids)
        self.context += self.plan.obs[self.turn] + self.plan.gen[self.turn]
        latency = self.plan.env_s[self.turn]
        self.turn += 1
        if self.turn >= self.num_turns:
            self.family.pacer.turns.pop(self.execution_id, None)
            return StepResult([], self.progress, done=True, reward=self.hits / self.num_turns)
        if latency > 0 and wait:
            await asyncio.sleep(latency / self.family.time_scale)
        self._announce()
        return StepResult([self._message()], self.progress)

    async def replay(self, action: Action) -> StepResult:
        """The turn as `step` took it, without waiting its tool latency again."""
        return await self.step(action, wait=False)

    async def close(self) -> None:
        self.family.pacer.turns.pop(self.execution_id, None)


class WorkloadFamily(TaskFamily):
    """Tasks `wl-<i>` whose executions follow the plans of a workload (see the module doc)."""

    name = "workload"

    def __init__(
        self,
        workload: Workload,
        pacer: Pacer | None = None,
        time_scale: float = 1.0,
        tokens_per_call: int = 1,
    ) -> None:
        if time_scale <= 0 or tokens_per_call < 1:
            raise InvalidArgument(
                f"workload environment: need time_scale > 0 and tokens_per_call >= 1, got {time_scale}, {tokens_per_call}"
            )
        self.workload, self.time_scale, self.tokens_per_call = workload, time_scale, tokens_per_call
        self.pacer = pacer or Pacer()
        self.plans = sample_executions(workload)
        self.tokens_per_execution = live_tokens_per_execution(workload, tokens_per_call)
        self._order = itertools.count()

    def task_ids(self, num_tasks: int) -> list[str]:
        return [f"wl-{i:05d}" for i in range(num_tasks)]

    def group_number(self, task_id: str, task_group: int, ordinal: int) -> int:
        """Groups are numbered in admission order (the module doc)."""
        del task_id, task_group
        return ordinal

    def plan_for(self, task_index: int, execution_id: str) -> tuple[ExecutionPlan, int]:
        """The plan of an execution and its ordinal (group n, member k: n x group_size + k): by its id
        when it has the rollout's form (n = the group's admission ordinal), else in start order (the
        task's own index picks the plan's task)."""
        w = self.workload
        m = _EXECUTION_RE.match(execution_id)
        if m:
            group, member = int(m.group(2)), int(m.group(3))
            step, slot = divmod(group, w.tasks_per_step)
        else:
            n = next(self._order)
            group, member = divmod(n, w.group_size)
            step, slot = group, task_index % w.tasks_per_step
        index = slot * w.group_size + member % w.group_size
        return self.plans[step % w.num_steps][index], group * w.group_size + member

    def make(self, task_id: str) -> WorkloadEnv:
        m = _TASK_RE.match(task_id)
        if not m:
            raise InvalidArgument(f"workload task ids look like 'wl-00003', got {task_id!r}")
        return WorkloadEnv(self, task_id, int(m.group(1)))
