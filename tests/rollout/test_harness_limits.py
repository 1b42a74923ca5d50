"""The external harness's limits sized for hours-long executions (rollout.harness.timeout_s,
memory_bytes, cpu_s): their defaults, 0 = off, and what the agent process really gets (a real agent
process started by `run_agent` as its sandbox user; it reports its own rlimits)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.rollout.agent_process import HarnessSettings, run_agent
from services.rollout.config import HarnessConfig, RolloutConfig
from services.rollout.environments.sandbox import SandboxUser

REPORT_LIMITS = (
    "import json, resource; print(json.dumps({n: resource.getrlimit(getattr(resource, n))[1] "
    "for n in ('RLIMIT_AS', 'RLIMIT_CPU')}))"
)


def external(**harness: object) -> HarnessConfig:
    return HarnessConfig.model_validate({"kind": "external", "command": ["a"], **harness})


def test_harness_limits_default_to_hours_and_the_cpu_limit_follows_the_wall_clock() -> None:
    cfg = RolloutConfig.model_validate(
        {"environment": "workspace", "harness": {"kind": "external", "command": ["a"]}}
    )
    assert cfg.harness.timeout_s == 4 * 3600
    assert cfg.harness.memory_bytes == 16 << 30
    assert cfg.harness.cpu_s is None and cfg.harness.cpu_limit_s() == 4 * 3600
    assert external(timeout_s=5 * 3600 + 0.5).cpu_limit_s() == 5 * 3600 + 1  # never below the wall clock
    assert external(timeout_s=120).cpu_limit_s() == 3600  # short runs keep an hour of CPU
    assert external(timeout_s=0).cpu_limit_s() == 0  # no wall-clock limit: no CPU limit either
    assert external(timeout_s=600, cpu_s=30).cpu_limit_s() == 30
    assert external(timeout_s=600, cpu_s=0).cpu_limit_s() == 0


def test_a_memory_limit_too_small_to_start_an_interpreter_is_refused_with_the_fix() -> None:
    with pytest.raises(ValidationError, match=r"below 64 MiB .* or set 0 for no address-space limit"):
        external(memory_bytes=1 << 20)
    assert external(memory_bytes=0).memory_bytes == 0
    with pytest.raises(ValidationError):
        external(timeout_s=-1)


async def _limits_seen_by_agent(settings: HarnessSettings, workdir: Path) -> dict[str, int]:
    user = SandboxUser()
    try:
        user.chown(workdir)
        run = await run_agent(
            [sys.executable, "-c", REPORT_LIMITS], "{}", workdir, {"PATH": "/usr/bin:/bin"}, settings, user
        )
    finally:
        user.close()
    assert run.exit_code == 0, run.errors
    return json.loads(run.output)


async def test_an_agent_gets_the_configured_rlimits_and_inherits_the_services_where_they_are_0(
    tmp_path: Path,
) -> None:
    limited = await _limits_seen_by_agent(
        HarnessSettings(command=["x"], timeout_s=60, memory_bytes=3 << 30, cpu_s=1234), tmp_path
    )
    assert limited == {"RLIMIT_AS": 3 << 30, "RLIMIT_CPU": 1234}

    unlimited = await _limits_seen_by_agent(
        HarnessSettings(command=["x"], timeout_s=0, memory_bytes=0, cpu_s=0), tmp_path
    )
    assert unlimited == {
        "RLIMIT_AS": resource.getrlimit(resource.RLIMIT_AS)[1],
        "RLIMIT_CPU": resource.getrlimit(resource.RLIMIT_CPU)[1],
    }
    # timeout_s 0: the agent ran to its own exit (it was not killed as timed out)
