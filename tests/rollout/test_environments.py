"""Environments. The workspace tests drive the environment with a SCRIPTED agent (a fake standing in
for the model at the outermost edge): it emits fixed tool calls, no LLM involved."""

import json
import os
import shutil
from pathlib import Path

import pytest

from gyre import tokenizer as tok
from services.rollout.environments import Action
from services.rollout.environments.longhorizon import (
    LongHorizonFamily,
    LongHorizonSpec,
    correct_action,
)
from services.rollout.environments.sandbox import SandboxViolation, Workspace
from services.rollout.environments.workspace import WorkspaceFamily

TASKS = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "workspace.jsonl"


def tool_action(*calls: tuple[str, dict]) -> Action:
    """A scripted completion: one <tool_call> per (name, arguments)."""
    ids: list[int] = []
    for name, args in calls:
        payload = json.dumps({"name": name, "arguments": json.dumps(args)})
        ids += [tok.TOOL_CALL_OPEN, *tok.encode(payload), tok.TOOL_CALL_CLOSE]
    return Action.from_ids([*ids, tok.EOS])


async def test_longhorizon_perfect_policy_finishes_with_reward_one() -> None:
    spec = LongHorizonSpec(max_turns=50)
    env = LongHorizonFamily(spec).make("lh-00007")
    msgs = await env.reset()
    while True:
        cue = ord(msgs[-1]["content"]) - ord("A")
        res = await env.step(Action.from_ids([correct_action(cue, spec.num_actions)]))
        if res.done or res.truncated:
            break
        msgs = res.messages
    assert res.done and res.reward == 1.0 and res.progress.milestones_reached == res.progress.milestones_total


async def test_longhorizon_wrong_policy_is_truncated_with_partial_progress() -> None:
    spec = LongHorizonSpec(max_turns=50, min_turns=20)
    env = LongHorizonFamily(spec).make("lh-00001")
    msgs = await env.reset()
    n = 0
    while True:
        cue = ord(msgs[-1]["content"]) - ord("A")
        right = correct_action(cue, spec.num_actions)
        action = right if n % 2 == 0 else (right + 1) % spec.num_actions  # every other action wrong
        res = await env.step(Action.from_ids([action]))
        n += 1
        if res.done or res.truncated:
            break
        msgs = res.messages
    assert res.truncated and 0 < res.progress.score() < 1


def test_longhorizon_horizons_are_heavy_tailed_and_seeded() -> None:
    fam = LongHorizonFamily(LongHorizonSpec(min_turns=3, max_turns=400))
    horizons = [fam.task(t).horizon for t in fam.task_ids(400)]
    assert horizons == [fam.task(t).horizon for t in fam.task_ids(400)]
    assert sorted(horizons)[len(horizons) // 2] < 10 and max(horizons) > 100


@pytest.mark.parametrize("task_id", ["ws-textstats", "ws-roman", "ws-stack"])
async def test_workspace_scores_scripted_full_solution_one(task_id: str) -> None:
    fam = WorkspaceFamily.from_jsonl(TASKS)
    env = fam.make(task_id)
    await env.reset()
    try:
        assert env.progress.tests_passed_fraction == 0.0
        writes = [("write_file", {"path": p, "content": c}) for p, c in fam.tasks[task_id].solution.items()]
        res = await env.step(tool_action(*writes, ("submit", {})))
        assert res.done and res.reward == 1.0
    finally:
        await env.close()


async def test_workspace_scores_half_solution_strictly_between_zero_and_one() -> None:
    env = WorkspaceFamily.from_jsonl(TASKS).make("ws-roman")
    await env.reset()
    try:
        half = "def to_roman(n):\n    return {4: 'IV', 1994: 'MCMXCIV'}[n]\n\n\ndef from_roman(s):\n    return 0\n"
        res = await env.step(tool_action(("write_file", {"path": "roman.py", "content": half})))
        assert not res.done and res.progress.tests_passed_fraction == 0.5
    finally:
        await env.close()


async def test_workspace_agent_cannot_write_outside_its_workspace(tmp_path: Path) -> None:
    env = WorkspaceFamily.from_jsonl(TASKS).make("ws-textstats")
    await env.reset()
    assert env.ws is not None
    outside = tmp_path / "escaped.txt"
    try:
        os.symlink(tmp_path, env.ws.root / "link")
        res = await env.step(
            tool_action(
                ("write_file", {"path": str(outside), "content": "x"}),
                ("write_file", {"path": "../../" + str(outside), "content": "x"}),
                ("write_file", {"path": "link/escaped.txt", "content": "x"}),
                ("read_file", {"path": "../../../../etc/hostname"}),
            )
        )
        assert not outside.exists()
        assert all(m["content"].startswith("error:") for m in res.messages)
    finally:
        await env.close()


def test_workspace_paths_that_stay_inside_are_allowed_and_final_symlinks_are_not_followed(
    tmp_path: Path,
) -> None:
    ws = Workspace()
    try:
        ws.write_file("a/b/../c.txt", "ok")
        assert ws.read_file("a/c.txt") == "ok"
        os.symlink(tmp_path / "target", ws.root / "dangling")
        with pytest.raises(SandboxViolation):
            ws.write_file("dangling", "x")
        assert not (tmp_path / "target").exists()
    finally:
        ws.close()


@pytest.mark.slow
async def test_workspace_command_is_killed_at_its_timeout_and_has_no_network() -> None:
    from services.rollout.environments.sandbox import SandboxLimits, network_namespace_available

    ws = Workspace(SandboxLimits(timeout_s=1.0))
    try:
        res = await ws.run_shell("sleep 30")
        assert res.timed_out
        if network_namespace_available():
            probe = "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)"
            res = await ws.run(["python3", "-c", probe])
            assert res.returncode != 0 and "unreachable" in res.output.lower()
    finally:
        ws.close()


# -- the sandbox: what an agent's commands can and cannot reach --------------------------------------
ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="uid isolation needs root; unprivileged, commands run as the service's own user (docs/rollout.md)",
)


def no_process_with(marker: str) -> bool:
    """True if no live process has `marker` in its command line (a sandbox's pids are namespaced)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return False
        except OSError:
            continue
    return True


async def test_workspace_commands_never_see_the_hidden_tests() -> None:
    env = WorkspaceFamily.from_jsonl(TASKS).make("ws-textstats")
    await env.reset()  # reset already scored once: the tests were on disk only during that scoring
    assert env.ws is not None
    try:
        # Leftovers of the scorer are test files (*.py). A task dataset (*.jsonl) holds the hidden tests by
        # design and may lie under /tmp with a clone of this repository (readable: logged as a warning by
        # WorkspaceFamily.from_jsonl); a listing of such clones could also push "searched" out of the
        # tool's bounded output, so matches are capped. Virtual environments and git stores are skipped:
        # a /tmp holding a few clones with their .venv took the grep past the command's timeout.
        search = (
            "grep -rl --include='*.py' --exclude-dir=.venv --exclude-dir=site-packages --exclude-dir=.git"
            " test_word_count_counts_words /tmp /var/tmp /dev/shm 2>/dev/null"
            " | head -5; echo searched"
        )
        res = await env.step(tool_action(("run", {"command": search}), ("read_file", {"path": "../"})))
        assert res.messages[0]["content"].strip().splitlines()[-1] == "searched"
        assert "test_word_count" not in res.messages[0]["content"]
        assert res.messages[1]["content"].startswith("error:")
        assert env.ws.list_files() == []  # the tests were never copied into the workspace
    finally:
        await env.close()


@ROOT_ONLY
async def test_workspace_commands_run_as_their_own_uid_and_cannot_read_root_only_files(
    tmp_path: Path,
) -> None:
    import tempfile

    shared = Path(tempfile.mkdtemp())
    os.chmod(shared, 0o755)
    secret = shared / "secret.txt"
    secret.write_text("root only")
    os.chmod(secret, 0o600)
    ws = Workspace()
    try:
        res = await ws.run_shell(f"id -u; cat {secret} /etc/shadow; echo exit=$?")
        uid = int(res.output.split()[0])
        assert uid != 0 and uid == ws.user.uid
        assert "root only" not in res.output and "Permission denied" in res.output
        assert (await ws.run_shell("ls /root")).returncode != 0
        # /etc/passwd is world-readable on Linux, so it stays readable, as for any unprivileged user.
    finally:
        ws.close()
        shutil.rmtree(shared)


@ROOT_ONLY
async def test_workspace_file_tools_do_not_read_a_hard_link_to_a_foreign_file(tmp_path: Path) -> None:
    ws = Workspace()
    secret = ws.root.parent / f"gyre-test-secret-{os.getpid()}"
    secret.write_text("root only")
    try:
        os.link(secret, ws.root / "link.txt")  # as if the agent could hard-link it (protected_hardlinks off)
        with pytest.raises(SandboxViolation, match="own"):
            ws.read_file("link.txt")
    finally:
        secret.unlink()
        ws.close()


async def test_shadowing_pytest_or_planting_a_conftest_scores_zero() -> None:
    env = WorkspaceFamily.from_jsonl(TASKS).make("ws-textstats")
    await env.reset()
    fake_pytest = (
        "import sys\n"
        "for a in sys.argv:\n"
        "    if a.endswith('.xml'):\n"
        "        open(a.split('=')[-1], 'w').write('<testsuite>' + '<testcase name=\"t\"/>' * 9 + '</testsuite>')\n"
        "sys.exit(0)\n"
    )
    conftest = (
        "import pytest\n\n"
        "@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n"
        "    outcome.get_result().outcome = 'passed'\n"
    )
    try:
        res = await env.step(
            tool_action(
                ("write_file", {"path": "pytest.py", "content": fake_pytest}),
                ("write_file", {"path": "conftest.py", "content": conftest}),
                ("write_file", {"path": "pytest.ini", "content": "[pytest]\naddopts = -p conftest\n"}),
                ("write_file", {"path": "sitecustomize.py", "content": fake_pytest}),
                ("submit", {}),
            )
        )
        assert res.done and res.reward == 0.0
    finally:
        await env.close()


def fallback_levels() -> list[str]:
    """The isolation level of this machine plus the weaker fallbacks this process can also run."""
    from services.rollout.environments.sandbox import isolation

    weaker = ["uid", "namespaces", "none"] if os.geteuid() == 0 else ["none"]
    return [isolation(), *[level for level in weaker if level != isolation()]]


def workspace_at(level: str) -> Workspace:
    """A Workspace forced down to `level` (to test the fallbacks of machines without namespaces)."""
    ws = Workspace()
    ws.user.level = level  # type: ignore[assignment]
    if level in ("namespaces", "none") and ws.user.lease is not None:
        ws.user.lease.release()  # as root at level `none`, commands run as this (root) user
        ws.user.lease = None
    return ws


@pytest.mark.slow
@pytest.mark.parametrize("level", fallback_levels())
async def test_processes_that_escape_their_command_are_gone_after_it_and_after_close(level: str) -> None:
    ws = workspace_at(level)
    daemon = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execvp('sleep', ['sleep', '987.656'])\n"
    )
    try:
        ws.write_file("daemon.py", daemon)
        res = await ws.run_shell(
            "setsid sleep 987.654 & nohup sleep 987.655 >/dev/null 2>&1 & python3 daemon.py; echo started"
        )
        assert "started" in res.output and not res.timed_out
        assert no_process_with("987.65")
        res = await ws.run_shell("(setsid sleep 987.657 &) ; sleep 30")  # killed at the timeout instead
        assert no_process_with("987.657")
    finally:
        ws.close()
    assert no_process_with("987.65")


@ROOT_ONLY
async def test_a_fork_loop_is_stopped_by_the_process_limit() -> None:
    from services.rollout.environments.sandbox import SandboxLimits

    ws = Workspace(SandboxLimits(max_processes=16, timeout_s=10))
    forks = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(5)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print('forked', n)\n"
    )
    try:
        ws.write_file("forks.py", forks)
        res = await ws.run(["python3", "forks.py"])
        assert "forked" in res.output and int(res.output.split()[-1]) < 16
    finally:
        ws.close()
