"""The active's durable writes (SyncWrites) in the simulator: the production decisions
(`server.sync_writes.DurableWrites`: which writes wait, when one commits, what a timeout or a
state change answers) in a shell of simulated timers, as `SyncWriteMonitor` is their shell of
futures and loop timers in the node.

What only the shell does: it arms each waiter's timer on the node's incarnation, hurries the
flush round a prepare waits for, wakes the node's producers after a commit or an abort, and
turns an outcome into the client's reply. The commit rule is `sync_writes.durability_met`,
looked up in its module at each call, so a mutant can replace it (mutations.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from changefeed.protocol.errors import StatusError
from changefeed.protocol.frame_info import DurabilityLevel
from changefeed.protocol.kv import MutationResult
from changefeed.server.sync_writes import DurableWrites, Waiter

if TYPE_CHECKING:
    from .node import SimNode

Answer = Callable[[str, object], None]
RETRY_ABORT_S = 0.05  # SyncWriteMonitor's: an abort that found memory full, tried again


class Durability:
    """Pending durable writes of one simulated node."""

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self.decisions = DurableWrites(
            lambda vb: node.vbuckets[vb],
            replicas_of=self._replicas_of,
            replication=node.tracker,
            required_of=self._required_of,
        )

    def _replicas_of(self, vb: int) -> list[str]:
        cluster_map = self.node.applied
        return [] if cluster_map is None else [n.name for n in cluster_map.replica_nodes(vb)]

    def _required_of(self, vb: int) -> list[str]:
        required = self.node.rules.required_replicas(self.node, vb)
        return [] if required is None else sorted(required)

    def waiting_on(self, vb: int) -> int:
        return self.decisions.waiting_on(vb)

    def track(
        self, vb: int, key: bytes, seqno: int, level: DurabilityLevel, timeout_s: float,
        answer: Answer,
    ) -> None:  # fmt: skip
        """Follow the prepare just queued; `answer` gets ("ok", result) or ("ambiguous", why)."""
        waiter = Waiter(vb, key, seqno, level, lambda outcome: self._answered(outcome, answer))
        self.node.timer(timeout_s, self._expire, waiter)
        self.node.request_flush(hurry=True)
        self.decisions.add(waiter)

    def on_progress(self, vb: int) -> None:
        self.decisions.on_progress(vb)

    def on_persisted(self, vbs: list[int]) -> None:
        self.decisions.on_persisted(vbs)

    def on_state_changed(self, vb: int) -> None:
        """`Effect.WAITERS_AMBIGUOUS`: the vbucket stopped being active here."""
        self.decisions.on_state_changed(vb)

    def _expire(self, waiter: Waiter) -> None:
        if self.decisions.expire(waiter):
            self.node.request_pump()  # the abort, if one was queued
        else:
            self.node.timer(RETRY_ABORT_S, self._expire, waiter)

    def _answered(self, outcome: MutationResult | StatusError, answer: Answer) -> None:
        if isinstance(outcome, MutationResult):
            self.node.request_pump()  # the commit streams to the replicas
            answer("ok", outcome)
        else:
            answer("ambiguous", str(outcome))
