"""One simulated node: real vbuckets over a real store, the node's glue, on simulated time.

Per node: a `changefeed.storage.Store` (durable=False: its commits are the simulated disk) in
a directory of its own, one `changefeed.vbucket.VBucket` per vbucket, a
`server.replication.ReplicationTracker` on the simulated clock, a `DcpProducer` per replica
connection and a `ReplicaFeed` per active it copies from (replication.py), its durable writes
(durability.py), and its cluster agent and orchestrator candidate (agent.py, orchestrator.py).

What the simulation decides for it, and only that: when things happen. Flushes are events
(`request_flush`: the 5 ms group-commit gap, longer on a slow disk); a crash drops memory —
the vbuckets are released unflushed and the store closed unclean — so a restart finds the
disk as the flusher last committed it; a pause delays every event and message of the node
to its end (its clock-driven work runs late, as after SIGSTOP).

A state change goes through `set_vbucket_state`, the simulated `ServerContext.set_vbucket_state`:
`VBucket.set_state` performs the vbucket's effects of the edge, this fans out the node's
(`vbucket_state.Effect`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from changefeed.checkpoint import CheckpointMemoryFullError
from changefeed.checkpoint.flusher import stage_round
from changefeed.cluster import rules as cluster_rules
from changefeed.protocol.dcp import StreamEndReason
from changefeed.protocol.errors import (
    DurabilityImpossibleError,
    KeyExistsError,
    KeyNotFoundError,
    NotMyVbucketError,
    StatusError,
    SyncWriteInProgressError,
)
from changefeed.protocol.frame_info import DurabilityLevel
from changefeed.server.bucket import ROUND_BYTES_MAX, VBucketSource
from changefeed.server.context import change_vbucket_state
from changefeed.server.replication import ReplicationTracker
from changefeed.storage import Store
from changefeed.vbmap import ClusterMap
from changefeed.vbucket import VBucket
from changefeed.vbucket_state import Effect, VBucketState

from .agent import Agent
from .durability import Durability
from .network import Conn, Network
from .orchestrator import Candidate
from .replication import ProducerEnd, SimFeed
from .scheduler import Scheduler

if TYPE_CHECKING:
    from .cluster import SimCluster

FLUSH_GAP_S = 0.005  # server/bucket.py: 5 ms between flush rounds to gather a group commit
HURRY_FLUSH_S = 0.0005  # a durable write's prepare cuts the gap short
PUMP_DELAY_S = 0.0002
STORE_MAP_BYTES = 64 << 20
# A restarted node took a write before it applied any map (docs/simulator.md, "What it found").
SERVED_BEFORE_MAP = "served_before_map"


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """A client's KV request (the fields the node needs of a memcached frame)."""

    client: str
    req_id: int
    op: str  # "get", "set" or "add"
    vb: int
    key: bytes
    value: bytes = b""
    cas: int = 0
    level: int = 0
    timeout_s: float = 1.5


class SimNode(VBucketSource):
    """A node process, with its lifecycle: `start`, `crash`, `pause`; the producers read its
    vbuckets as they read a bucket's (`server.bucket.VBucketSource`)."""

    def __init__(self, cluster: SimCluster, name: str, path: Path) -> None:
        self.cluster = cluster
        self.sched: Scheduler = cluster.sched
        self.net: Network = cluster.net
        self.name = name
        self.path = path
        self.rules = cluster.rules
        self.config = cluster.config
        self.up = False
        self.incarnation = 0
        self.paused_until = 0.0
        self.disk_delay_s = 0.0  # a slow disk: extra wait before each flush
        self.rng = self.sched.stream(f"node:{name}")
        self.store: Store | None = None
        self.vbuckets: dict[int, VBucket] = {}
        self.tracker = self._new_tracker()
        self.durability = Durability(self)
        self.applied: ClusterMap | None = None
        self.feeds: dict[str, SimFeed] = {}
        self.producers: dict[int, ProducerEnd] = {}
        self.own_conns: dict[int, Conn] = {}
        self.agent = Agent(self)
        self.candidate = Candidate(self)
        self._flush_due = False
        self._pump_due = False
        self.net.register(name, self.gate)

    # -- lifecycle ------------------------------------------------------------------------------

    def gate(self) -> float | None:
        if not self.up:
            return None
        return max(self.sched.now, self.paused_until)

    def start(self) -> None:
        assert not self.up, self.name
        self.up = True
        self.incarnation += 1
        self.store = Store(self.path, durable=False, map_size_bytes=STORE_MAP_BYTES)
        for vb in range(self.config.vbuckets):
            self.vbuckets[vb] = VBucket(
                self.store,
                vb,
                state=VBucketState.DEAD,
                clock=self.sched.wall_clock,
                rng=random.Random(self.rng.getrandbits(64)),
            )
        self.tracker = self._new_tracker()
        self.durability = Durability(self)
        self.applied = None
        self.agent = Agent(self)
        self.candidate = Candidate(self)
        clean = self.store.was_clean_shutdown
        self.agent.holds_branch = {  # `NodeAgent.__init__`, before any state changes
            vb: cluster_rules.copy_holds_its_branch(
                v.state, clean, bool(v.failover_log.dropped_above)
            )
            for vb, v in sorted(self.vbuckets.items())
        }
        if self.rules.recovered_pending:  # `NodeAgent.__init__`: no active before a map
            for vb in sorted(self.vbuckets):
                recovered = cluster_rules.recovered_state(
                    self.vbuckets[vb].state, holds_branch=self.agent.holds_branch[vb]
                )
                self.set_vbucket_state(vb, recovered)
        self.sched.record("start", self.name)
        self.agent.start()
        self.candidate.start()

    def crash(self) -> None:
        """kill -9: memory gone, the store as the flusher last committed it."""
        if not self.up:
            return
        self.sched.record("crash", self.name)
        self.up = False
        self.incarnation += 1
        for conn in sorted(self.net.conns.values(), key=lambda c: c.id):
            if self.name in conn.ends:
                conn.crash(self.name)
        self.feeds.clear()
        self.producers.clear()
        self.own_conns.clear()
        for vbucket in self.vbuckets.values():
            vbucket.release()
        self.vbuckets.clear()
        assert self.store is not None
        self.store.close(clean=False)
        self.store = None
        self._flush_due = self._pump_due = False

    def stop_clean(self) -> None:
        """End of run: flush and close (the checker then reads the store)."""
        if self.up:
            self.flush()

    def pause(self, duration_s: float) -> None:
        self.paused_until = max(self.paused_until, self.sched.now + duration_s)
        self.sched.record("pause", self.name, duration_s)

    def _new_tracker(self) -> ReplicationTracker:
        return ReplicationTracker(
            lambda vb: self.vbuckets[vb].high_seqno,
            lag_max_s=self.config.replica_lag_max_s,
            clock=self.sched.monotonic,
        )

    # -- time -----------------------------------------------------------------------------------

    def timer(self, delay_s: float, callback: Callable[..., None], *args: Any) -> None:
        """Run `callback` after `delay_s` on this node's incarnation (late if paused)."""
        self.sched.after(delay_s, self._fire, self.incarnation, callback, args)

    def _fire(self, incarnation: int, callback: Callable[..., None], args: tuple) -> None:
        if incarnation != self.incarnation or not self.up:
            return
        if self.paused_until > self.sched.now:
            self.sched.at(self.paused_until, self._fire, incarnation, callback, args)
            return
        callback(*args)

    def if_current(self, incarnation: int, callback: Callable[..., None], *args: Any) -> None:
        """Run a message handler only if the node has not restarted since it was set up."""
        if incarnation == self.incarnation and self.up:
            callback(*args)

    def bound(self, callback: Callable[[Any], None]) -> Callable[[Any], None]:
        """A reply handler for a call made now (dropped if the node restarted meanwhile)."""
        incarnation = self.incarnation
        return lambda result: self.if_current(incarnation, callback, result)

    # -- storage --------------------------------------------------------------------------------

    def request_flush(self, *, hurry: bool = False) -> None:
        if not self._flush_due:
            self._flush_due = True
            gap = HURRY_FLUSH_S if hurry else FLUSH_GAP_S
            self.timer(gap + self.disk_delay_s, self.flush)

    def flush(self) -> None:
        """One flush round, `checkpoint.flusher.stage_round` as `server.bucket.Bucket` runs it:
        every vbucket with queued items staged into one batch, committed in one transaction
        (here at once: the simulated disk is the store's commit; a slow disk delays the round),
        then the persisted listeners (durable writes, the replica feeds' persisted acks)."""
        self._flush_due = False
        store = self.store
        assert store is not None
        flushers = (self.vbuckets[vb].flusher for vb in sorted(self.vbuckets))
        flush_round = stage_round(store, flushers, ROUND_BYTES_MAX)
        if flush_round is None:
            return
        if flush_round.cut_short:
            self.request_flush()  # the rest go in the next round
        store.commit_batch(flush_round.batch)
        written, moved = flush_round.committed()
        self.durability.on_persisted(moved)
        for source in sorted(self.feeds):
            feed = self.feeds[source]
            if hasattr(feed, "on_persisted"):  # the feed's persisted listener
                feed.on_persisted(moved)
            elif written:
                feed.poke(0.0)

    # -- replication ----------------------------------------------------------------------------

    def on_conn_message(self, conn: Conn, data: bytes) -> None:
        """This node's end of a DCP connection a replica or the consumer opened to it (run
        only while it is up: the network drops what arrives while it is down)."""
        if self.rules.fencing:
            self.agent.check_fence()  # before serving anything it received
        end = self.producers.get(conn.id)
        if end is None and ProducerEnd.opens(data):
            end = self.producers[conn.id] = ProducerEnd(self, conn)
            incarnation = self.incarnation
            conn.on_close[self.name] = lambda: self.if_current(
                incarnation, self._producer_closed, conn.id
            )
        if end is None:  # opened to an earlier incarnation of this node: a reset
            conn.close(self.name)
            return
        end.receive(data)

    def disconnect_replica(self, replica: str) -> None:
        """Hang up this node's DCP connections from `replica` (`DcpPump.disconnect`: the
        connection is lost here at once, its streams closed at the tracker)."""
        for conn_id in sorted(self.producers):
            end = self.producers[conn_id]
            if end.replica == replica:
                end.conn.close(self.name)
                self._producer_closed(conn_id)

    def _producer_closed(self, conn_id: int) -> None:
        end = self.producers.pop(conn_id, None)
        if end is not None:
            end.closed()

    def request_pump(self) -> None:
        if not self._pump_due:
            self._pump_due = True
            self.timer(PUMP_DELAY_S, self._pump)

    def _pump(self) -> None:
        self._pump_due = False
        more = False
        for conn_id in sorted(self.producers):
            more |= self.producers[conn_id].pump()
        if more:
            self.request_pump()

    def set_vbucket_state(self, vb: int, state: VBucketState) -> None:
        """`ServerContext.set_vbucket_state`: the same `change_vbucket_state`, with this
        node's producers for the streams to end."""
        edge = change_vbucket_state(
            self.vbuckets[vb],
            state,
            waiters=self.durability,
            end_streams=lambda: self._end_streams(vb),
            replication=self.tracker,
        )
        if edge is None:
            return
        self.sched.record("state", self.name, vb, state.value)
        if Effect.PREPARES_COMMITTED in edge.effects:
            self.request_pump()

    def _end_streams(self, vb: int) -> None:
        for conn_id in sorted(self.producers):
            self.producers[conn_id].producer.end_stream(vb, StreamEndReason.STATE_CHANGED)
        self.request_pump()

    def place_feeds(self, sources: dict[str, set[int]]) -> None:
        """`NodeAgent._place_feeds`: one feed per active copied from; restarted only when its
        vbuckets or source changed."""
        for source in sorted(self.feeds):
            feed = self.feeds[source]
            if sources.get(source) != set(feed.vbuckets):
                feed.close()
                del self.feeds[source]
        for source in sorted(sources):
            if source not in self.feeds:
                feed = SimFeed(self, source, sources[source])
                self.feeds[source] = feed
                feed.start()

    # -- clients --------------------------------------------------------------------------------

    def on_request(self, request: Request) -> None:
        """A client's request (the node serves by its vbuckets' states, as the real one)."""
        answer = self._answerer(request)
        if not self.rules.may_serve(self, request.vb):
            answer("nmvb", self.applied)
            return
        vbucket = self.vbuckets[request.vb]
        try:
            if request.op == "get":
                if not vbucket.state.is_active:
                    raise NotMyVbucketError("not active")
                document = vbucket.get(request.key)
                answer("ok", None if document is None else (document.value, document.cas))
                return
            level = request.level
            active = vbucket.state.is_active
            if level and active:
                self.durability.decisions.check_possible(request.vb)
            if request.op == "add":
                result = vbucket.add(request.key, request.value, level=level)
            else:
                result = vbucket.set(request.key, request.value, cas=request.cas, level=level)
        except NotMyVbucketError:
            answer("nmvb", self.applied)
            return
        except DurabilityImpossibleError:
            answer("impossible", None)
            return
        except (KeyExistsError, KeyNotFoundError):
            answer("cas_mismatch", None)
            return
        except (SyncWriteInProgressError, CheckpointMemoryFullError):
            answer("tmpfail", None)
            return
        except StatusError as error:
            answer("error", type(error).__name__)
            return
        self.request_pump()
        self.request_flush()
        if self.applied is None and self.incarnation > 1:
            self.cluster.note(SERVED_BEFORE_MAP)
        if not level:
            answer("ok", (result.seqno, result.cas))
            return
        self.durability.track(
            request.vb,
            request.key,
            result.seqno,
            DurabilityLevel(level),
            request.timeout_s,
            lambda outcome, detail: self._durable_answer(answer, outcome, detail),
        )

    def on_config(self, client_name: str) -> None:
        """GET_CLUSTER_CONFIG: the map this node applied."""
        client = self.cluster.clients_by_name[client_name]
        self.net.send(self.name, client_name, client.on_config, self.applied)

    def _durable_answer(
        self, answer: Callable[[str, Any], None], outcome: str, detail: Any
    ) -> None:
        if outcome == "ok":
            answer("ok", (detail.seqno, detail.cas))
        else:
            answer("ambiguous", detail)

    def _answerer(self, request: Request) -> Callable[[str, Any], None]:
        client = self.cluster.clients_by_name[request.client]

        def answer(outcome: str, detail: Any) -> None:
            self.sched.record("reply", self.name, request.client, request.req_id, outcome)
            self.net.send(
                self.name, request.client, client.on_reply, request.req_id, outcome, detail
            )

        return answer
