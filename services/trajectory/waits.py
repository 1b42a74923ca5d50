"""What the trajectory service waits on, for the job's watchdog (gyre/waits.py): groups that cannot
be scored yet and why, and scored work no trainer has taken."""

from __future__ import annotations

from gyre.v1 import waits_pb2
from gyre.waits import wait
from services.trajectory.scoring import Ending
from services.trajectory.state import TrajectoryState


def trajectory_waits(state: TrajectoryState, group_size: int) -> list[waits_pb2.Wait]:
    """Open groups by what holds them (members missing, running, or ended with calls not stored
    yet) and scored groups not batched yet; computed from the in-memory state."""
    short = running = unstored = 0
    for g in state.groups.values():
        if g.state != "open":
            continue
        if group_size and len(g.members) < group_size:
            short += 1
        tree = None
        for eid in g.members:
            info = state.executions[eid]
            if info.ending is Ending.RUNNING:
                running += 1
                continue
            tree = tree or state.trees.get(g.task_id)
            stored = len(tree.calls_by_execution.get(eid, {})) if tree else 0
            if info.num_calls is not None and stored < info.num_calls:
                unstored += 1
    num_open = sum(1 for g in state.groups.values() if g.state == "open")
    out = []
    if num_open:
        out.append(
            wait(
                "scoring",
                f"{num_open} open groups: {short} missing members, {running} executions running, "
                f"{unstored} ended with calls not stored yet",
            )
        )
    scored = sum(1 for g in state.groups.values() if g.state == "scored")
    if scored:
        out.append(wait("batching", f"{scored} scored groups not batched yet (waiting for a fill or a pull)"))
    return out
