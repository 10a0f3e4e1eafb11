"""The active side of replication: what each replica of each active vbucket has acknowledged,
and whether it is in the in-sync set.

A replica pulls its vbucket over a DCP stream opened with role REPLICA and its node name as
``consumer_name``, and acknowledges with DCP_SEQNO_ACKNOWLEDGED the seqnos it has received and
persisted. Membership of the in-sync set follows Kafka's ``replica.lag.time.max.ms`` rule — time,
not item count: a replica is in sync while its stream is open and it has been fully caught up
(acked the active's high seqno, or the high seqno as of its previous ack) within `lag_max_s`.
One rule covers the stuck replica (no acks: the time runs out) and the slow one (acks that never
reach the end). A replica whose stream is gone is out at once.

Sans-IO apart from the clock it is given: a replica connection's DCP pump feeds it stream
open/close and acks (server/dcp_pump.py), it tells its listeners (the durable-write monitor)
which vbucket moved, and STAT and /metrics read `snapshot`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

# How long after a vbucket becomes active here its map's replicas count as reachable before
# their streams open (they open them once they apply the same map: tens of milliseconds on a
# quiet machine). Within it a durable write waits for their acks (or its timeout: AMBIGUOUS)
# instead of being refused DURABILITY_IMPOSSIBLE, which SDKs do not retry: a write right after
# a failover or a cluster start met that. It only decides refusal; a commit still needs the acks.
CONNECT_GRACE_S = 3.0


@dataclasses.dataclass(slots=True)
class ReplicaProgress:
    """One replica copy of one active vbucket, as the active sees it.

    Attributes:
        replica: the replica's node name (DCP_OPEN ``consumer_name``).
        received_seqno: highest seqno the replica acknowledged as received.
        persisted_seqno: highest seqno it acknowledged as persisted.
        connected: a replica stream from it is open now.
        opened_s: when its current stream opened (monotonic seconds).
        last_caught_up_s: when it last was fully caught up (monotonic seconds).
        high_at_last_ack: the active's high seqno at its previous ack (Kafka's rule).
        catchup_started_s: when the current catch-up began (None while caught up).
        catchups_started, catchups_finished: counts over the node's life.
        catchup_seconds_last: how long the last finished catch-up took.
        items_acked: items acknowledged over the node's life (seqno distance).
    """

    replica: str
    received_seqno: int = 0
    persisted_seqno: int = 0
    connected: bool = False
    opened_s: float = float("-inf")
    last_caught_up_s: float = float("-inf")
    high_at_last_ack: int = 0
    catchup_started_s: float | None = None
    catchups_started: int = 0
    catchups_finished: int = 0
    catchup_seconds_last: float = 0.0
    items_acked: int = 0
    stream_id: int = 0  # which of its streams is the current one (stream_opened's answer)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """What `snapshot` reports for one (vbucket, replica)."""

    vb: int
    replica: str
    received_seqno: int
    persisted_seqno: int
    lag_items: int
    lag_s: float
    in_sync: bool
    connected: bool


class ReplicationTracker:
    """Per active vbucket and replica: acked seqnos, caught-up time, in-sync membership.

    Args:
        high_seqno_of: the active's current high seqno of a vbucket.
        lag_max_s: Kafka's replica.lag.time.max.ms, in seconds.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        high_seqno_of: Callable[[int], int],
        *,
        lag_max_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert lag_max_s > 0, lag_max_s
        self._high_seqno_of = high_seqno_of
        self.lag_max_s = lag_max_s
        self._clock = clock
        self._progress: dict[tuple[int, str], ReplicaProgress] = {}
        self._activated_s: dict[int, float] = {}  # when each vbucket became active here
        self._streams_opened = 0
        # Told the vbucket whose replicas' progress moved or whose stream closed (the
        # durable-write monitor subscribes: sync_writes.py).
        self.listeners: list[Callable[[int], None]] = []

    def progress(self, vb: int, replica: str) -> ReplicaProgress:
        key = (vb, replica)
        found = self._progress.get(key)
        if found is None:
            found = self._progress[key] = ReplicaProgress(replica)
        return found

    def stream_opened(self, vb: int, replica: str, start_seqno: int) -> int:
        """A replica stream starts at `start_seqno`: the replica holds that much, and no more.
        What it acknowledged on earlier streams does not count: a replica that restarted asks
        from what its disk kept and has lost what it held only in memory, so its acks start
        again from here (kept, they would count it caught up, and holding prepares, that it
        no longer has)."""
        p = self.progress(vb, replica)
        p.connected = True
        p.opened_s = self._clock()
        p.received_seqno = start_seqno
        p.persisted_seqno = min(p.persisted_seqno, start_seqno)
        if p.received_seqno < self._high_seqno_of(vb) and p.catchup_started_s is None:
            p.catchup_started_s = self._clock()
            p.catchups_started += 1
        self._observe(vb, p, p.received_seqno)
        self._streams_opened += 1  # node-wide: unique across forget() too
        p.stream_id = self._streams_opened
        return p.stream_id

    def stream_closed(self, vb: int, replica: str, stream_id: int | None = None) -> None:
        """A replica stream ended. Given its `stream_id` (what `stream_opened` answered), only
        if it is still the current one: an old connection of the replica that closes after
        a newer one opened its stream must not mark the new stream disconnected."""
        p = self._progress.get((vb, replica))
        if p is not None and (stream_id is None or stream_id == p.stream_id):
            p.connected = False
        self._tell(vb)

    def _tell(self, vb: int) -> None:
        for listener in self.listeners:
            listener(vb)

    def acknowledged(self, vb: int, replica: str, received: int, persisted: int) -> None:
        """DCP_SEQNO_ACKNOWLEDGED from `replica` (seqnos never move back: a stale ack is kept
        out, a rollback opens a new stream that reports its own start)."""
        p = self.progress(vb, replica)
        if received > p.received_seqno:
            p.items_acked += received - p.received_seqno
            p.received_seqno = received
        p.persisted_seqno = max(p.persisted_seqno, min(persisted, p.received_seqno))
        self._observe(vb, p, p.received_seqno)
        self._tell(vb)

    def rolled_back(self, vb: int, replica: str, seqno: int) -> None:
        """The replica truncated to `seqno` (a stream it requested got ROLLBACK)."""
        p = self.progress(vb, replica)
        p.received_seqno = min(p.received_seqno, seqno)
        p.persisted_seqno = min(p.persisted_seqno, seqno)

    def _observe(self, vb: int, p: ReplicaProgress, acked: int) -> None:
        now = self._clock()
        high = self._high_seqno_of(vb)
        if acked >= high:
            p.last_caught_up_s = now
        elif acked >= p.high_at_last_ack:
            # Reached the end as it was at the previous ack (Kafka: the leader's LEO as of
            # the previous fetch), so it was caught up then, and is keeping up.
            p.last_caught_up_s = max(p.last_caught_up_s, now)
        p.high_at_last_ack = high
        if acked >= high and p.catchup_started_s is not None:
            p.catchup_seconds_last = now - p.catchup_started_s
            p.catchup_started_s = None
            p.catchups_finished += 1

    def in_sync(self, vb: int, replica: str) -> bool:
        p = self._progress.get((vb, replica))
        if p is None or not p.connected:
            return False
        if p.received_seqno >= self._high_seqno_of(vb):
            return True
        return self._clock() - p.last_caught_up_s <= self.lag_max_s

    def in_sync_set(self, vb: int) -> list[str]:
        """The replicas of `vb` in sync now (the active itself is always in its own set)."""
        return sorted(r for (v, r) in self._progress if v == vb and self.in_sync(v, r))

    def forget(self, vb: int) -> None:
        """The vbucket is no longer active here: its replicas report elsewhere now."""
        for key in [k for k in self._progress if k[0] == vb]:
            del self._progress[key]
        self._activated_s.pop(vb, None)

    def activated(self, vb: int) -> None:
        """The vbucket became active here: its replicas are opening their streams."""
        self._activated_s[vb] = self._clock()

    def reachable(self, vb: int, replica: str) -> bool:
        """Whether a durable write may count on `replica` of `vb`: its stream is open, or the
        vbucket became active here less than CONNECT_GRACE_S ago and the replica has not
        opened a stream since (it is still connecting; one that opened and closed is gone)."""
        p = self._progress.get((vb, replica))
        if p is not None and p.connected:
            return True
        since = self._activated_s.get(vb)
        if since is None or self._clock() - since >= CONNECT_GRACE_S:
            return False
        return p is None or p.opened_s < since

    def snapshot(self) -> Iterator[ReplicaStatus]:
        now = self._clock()
        for (vb, replica), p in sorted(self._progress.items()):
            high = self._high_seqno_of(vb)
            lag_items = max(0, high - p.received_seqno)
            lag_s = 0.0 if lag_items == 0 else max(0.0, now - p.last_caught_up_s)
            yield ReplicaStatus(
                vb,
                replica,
                p.received_seqno,
                p.persisted_seqno,
                lag_items,
                lag_s if lag_s != float("inf") else -1.0,
                self.in_sync(vb, replica),
                p.connected,
            )

    def counters(self) -> dict[str, float]:
        """Node-wide totals for STAT and /metrics."""
        values = list(self._progress.values())
        return {
            "replication_catchups_started": sum(p.catchups_started for p in values),
            "replication_catchups_finished": sum(p.catchups_finished for p in values),
            "replication_catchup_seconds_last": max(
                (p.catchup_seconds_last for p in values), default=0.0
            ),
            "replication_items_acked": sum(p.items_acked for p in values),
            "replication_streams": sum(1 for p in values if p.connected),
        }
