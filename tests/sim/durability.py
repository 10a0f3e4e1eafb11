"""The active's durable writes (SyncWrites) in the simulator: the plumbing of
`server.sync_writes.SyncWriteMonitor` without asyncio, the decision by its rule.

Which writes wait, their timers and their answers are kept here (the monitor's futures and
`call_later` cannot run without an event loop); *whether* a prepare may commit is one call to
`changefeed.server.sync_writes.durability_met` with the acks the monitor would pass (received
seqnos for `majority`, persisted for `persistToMajority`, one per replica slot of the chain in
the map), looked up through the module so a test can replace the rule. When the rules
module grows a confirmed in-sync record (issue 25), `required_acks` is passed too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from changefeed.checkpoint import CheckpointMemoryFullError
from changefeed.protocol.errors import StatusError
from changefeed.protocol.frame_info import DurabilityLevel
from changefeed.server import sync_writes
from changefeed.vbucket_state import VBucketState

if TYPE_CHECKING:
    from .node import SimNode

Answer = Callable[[str, object], None]


@dataclasses.dataclass(slots=True)
class Pending:
    vb: int
    key: bytes
    seqno: int
    level: DurabilityLevel
    answer: Answer
    deadline_s: float


class Durability:
    """Pending durable writes of one simulated node."""

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self.pending: dict[int, dict[bytes, Pending]] = {}
        self.committed = 0
        self.ambiguous = 0

    def replicas_of(self, vb: int) -> list[str]:
        cluster_map = self.node.applied
        return [] if cluster_map is None else [n.name for n in cluster_map.replica_nodes(vb)]

    def possible(self, vb: int) -> bool:
        """`SyncWriteMonitor.check_possible`: a majority of the chain reachable."""
        replicas = self.replicas_of(vb)
        tracker = self.node.tracker
        reachable = 1 + sum(1 for r in replicas if tracker.progress(vb, r).connected)
        return reachable >= (1 + len(replicas)) // 2 + 1

    def track(self, pending: Pending, timeout_s: float) -> None:
        self.pending.setdefault(pending.vb, {})[pending.key] = pending
        self.node.timer(timeout_s, self._expire, pending)
        self.node.request_flush(hurry=True)
        self.check(pending.vb)

    def on_progress(self, vb: int) -> None:
        if vb in self.pending:
            self.check(vb)

    def on_persisted(self) -> None:
        for vb in sorted(self.pending):
            self.check(vb)

    def on_state_changed(self, vb: int) -> None:
        """`Effect.WAITERS_AMBIGUOUS`: the vbucket stopped being active here."""
        for pending in list(self.pending.get(vb, {}).values()):
            self._finish(pending, "ambiguous", "no longer active")
        assert vb not in self.pending, vb

    def check(self, vb: int) -> None:
        waiting = self.pending.get(vb)
        if not waiting:
            return
        vbucket = self.node.vbuckets[vb]
        if vbucket.state is not VBucketState.ACTIVE:
            for pending in list(waiting.values()):
                self._finish(pending, "ambiguous", "no longer active")
            return
        replicas = self.replicas_of(vb)
        persisted_here = vbucket.persisted_seqno
        for pending in list(waiting.values()):
            if not self._met(vb, pending, replicas, persisted_here):
                continue
            try:
                result = vbucket.commit(pending.key)
            except CheckpointMemoryFullError:
                return
            except StatusError as error:
                self._finish(pending, "ambiguous", str(error))
                continue
            self.committed += 1
            self.node.request_pump()
            self._finish(pending, "ok", result)

    def _met(self, vb: int, pending: Pending, replicas: list[str], persisted_here: int) -> bool:
        tracker = self.node.tracker
        if pending.level is DurabilityLevel.PERSIST_TO_MAJORITY:
            acked = [tracker.progress(vb, r).persisted_seqno for r in replicas]
        else:
            acked = [tracker.progress(vb, r).received_seqno for r in replicas]
        required = self.node.rules.required_replicas(self.node, vb)
        if required is None:
            return sync_writes.durability_met(pending.seqno, persisted_here, acked)
        if pending.level is DurabilityLevel.PERSIST_TO_MAJORITY:
            needed = [tracker.progress(vb, r).persisted_seqno for r in sorted(required)]
        else:
            needed = [tracker.progress(vb, r).received_seqno for r in sorted(required)]
        return sync_writes.durability_met(pending.seqno, persisted_here, acked, needed)

    def _expire(self, pending: Pending) -> None:
        waiting = self.pending.get(pending.vb)
        if waiting is None or waiting.get(pending.key) is not pending:
            return
        vbucket = self.node.vbuckets[pending.vb]
        if vbucket.state is VBucketState.ACTIVE:
            try:
                vbucket.abort(pending.key)
                self.node.request_pump()
            except CheckpointMemoryFullError:
                self.node.timer(0.05, self._expire, pending)
                return
        self._finish(pending, "ambiguous", "timeout")

    def _finish(self, pending: Pending, outcome: str, detail: object) -> None:
        waiting = self.pending.get(pending.vb)
        if waiting is not None and waiting.get(pending.key) is pending:
            del waiting[pending.key]
            if not waiting:
                del self.pending[pending.vb]
        if outcome != "ok":
            self.ambiguous += 1
        pending.answer(outcome, detail)
