"""Groups that will never be trained, announced so that the rollout generates them anew.

The rollout admits at most G * (latest_version + 1 + S) groups (gyre.pipeline_rules). A group that
ends ``empty`` (nothing generated), ``rejected`` (could not be scored) or ``dropped_stale`` (fell
behind the staleness bound before it was packed) would keep its admission slot for good: after
enough of them — typically after a fault delays ingest — the trainer waits for a batch that the
rollout will never generate, while the rollout waits for a version that needs that batch. Each such
group is announced once per process as a GroupDroppedEvent (event id ``dropped.<group_id>``, so
JetStream stores a re-announcement after a restart once; the rollout refunds a group at most once).
"""

from __future__ import annotations

import time

from gyre.v1 import events_pb2
from services.trajectory.state import TrajectoryState

# Final group states that train nothing (services/trajectory/state.py GroupInfo.state).
NEVER_TRAINED = ("empty", "rejected", "dropped_stale")


class DropAnnouncer:
    """Finds the groups that reached a state in NEVER_TRAINED since the last call."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._announced: set[str] = set()

    def new_drops(self, state: TrajectoryState) -> list[events_pb2.GroupDroppedEvent]:
        """One event per group newly in a never-trained state (after a restart: every such group of
        the loaded state once more, which the rollout ignores for groups it did not start)."""
        now = time.time()
        out = []
        for gid, g in sorted(state.groups.items()):
            if g.state in NEVER_TRAINED and gid not in self._announced:
                out.append(
                    events_pb2.GroupDroppedEvent(
                        event_id=f"dropped.{gid}",
                        run_id=self.run_id,
                        task_id=g.task_id,
                        group_id=gid,
                        reason=g.state,
                        created_unix_s=now,
                    )
                )
        return out

    def published(self, group_id: str) -> None:
        """The event of `group_id` is on the bus (JetStream acked it): never announce it again here."""
        self._announced.add(group_id)
