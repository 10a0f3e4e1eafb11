"""Simulated links between nodes, clients, the consumer and the metadata store.

Two kinds of traffic, as on a real network:

- **Datagrams** (`Network.send`): a client's KV request and its reply, a node's call to the
  metadata store and its answer. Each travels alone with a random delay, so two may arrive in
  either order; a link may drop or duplicate them (an SDK or etcd client retrying). A message
  whose link is cut when it is sent or when it would arrive is lost.
- **Connections** (`Conn`): a replica feed's DCP connection. TCP: bytes arrive in order, never
  twice; while the link is cut they wait (retransmission), and a connection whose traffic has
  been stuck for `dead_after_s` is declared dead at both ends (the peers' idle timeouts), as
  is a connection to a node that crashed (reset, seen at once when the link is up).

Faults (set by tests/sim/faults.py): a directed `cut` (a one-way partition is one direction;
a full one, both), extra delay on a link, and a global reorder/duplicate level.

Each endpoint registers a gate: None while it is down (messages to it are lost), else the
simulated time from which it may process (a paused node: later; messages wait, in order).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from .scheduler import Scheduler

Gate = Callable[[], float | None]

DELAY_MIN_S = 0.0002
DELAY_MAX_S = 0.0015
RETRANSMIT_S = 0.1  # a cut connection tries again this often
DEAD_AFTER_S = 3.0  # a connection stuck this long is dead at both ends (noop/idle timeouts)


@dataclasses.dataclass(slots=True)
class Faults:
    """The network's fault levels now (faults.py changes them)."""

    cut: Counter[tuple[str, str]] = dataclasses.field(default_factory=Counter)
    extra_delay_s: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    jitter_s: float = 0.0  # added uniformly to datagrams: reorder
    duplicate_p: float = 0.0
    drop_p: float = 0.0


class Network:
    """Delivers datagrams and connection traffic between named endpoints."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.rng = sched.stream("network")
        self.faults = Faults()
        self.gates: dict[str, Gate] = {}
        self.conns: dict[int, Conn] = {}
        self._next_conn = 0
        self.sent = 0
        self.lost = 0

    def register(self, name: str, gate: Gate) -> None:
        self.gates[name] = gate

    def is_cut(self, src: str, dst: str) -> bool:
        cut = self.faults.cut
        return bool(cut) and cut[(src, dst)] > 0

    def delay(self, src: str, dst: str) -> float:
        base = self.rng.uniform(DELAY_MIN_S, DELAY_MAX_S)
        return base + self.faults.extra_delay_s.get((src, dst), 0.0)

    # -- datagrams ------------------------------------------------------------------------------

    def send(self, src: str, dst: str, callback: Callable[..., None], *args: Any) -> None:
        """Send one datagram; `callback(*args)` runs at `dst` if it arrives."""
        self.sent += 1
        faults = self.faults
        if self.is_cut(src, dst) or (faults.drop_p and self.rng.random() < faults.drop_p):
            self.lost += 1
            return
        copies = 2 if faults.duplicate_p and self.rng.random() < faults.duplicate_p else 1
        for _ in range(copies):
            delay = self.delay(src, dst) + self.rng.uniform(0.0, faults.jitter_s)
            self.sched.after(delay, self._arrive, src, dst, callback, args)

    def _arrive(self, src: str, dst: str, callback: Callable[..., None], args: tuple) -> None:
        if self.is_cut(src, dst):
            self.lost += 1
            return
        ready = self.gates[dst]()
        if ready is None:
            self.lost += 1
            return
        if ready > self.sched.now:  # paused: it reads its socket when it wakes up
            self.sched.at(ready, self._arrive, src, dst, callback, args)
            return
        callback(*args)

    # -- connections ----------------------------------------------------------------------------

    def cut_changed(self) -> None:
        """A cut was made: every connection across it dies unless the cut heals within
        `DEAD_AFTER_S` (the peers' noops go unanswered even when nothing else is sent)."""
        for conn in sorted(self.conns.values(), key=lambda c: c.id):
            a, b = conn.ends
            if self.is_cut(a, b) or self.is_cut(b, a):
                self.sched.after(DEAD_AFTER_S, conn.check_cut)

    def connect(self, a: str, b: str) -> Conn:
        self._next_conn += 1
        conn = Conn(self, self._next_conn, a, b)
        self.conns[conn.id] = conn
        return conn


class Conn:
    """An ordered, reliable-while-alive byte connection between endpoints `a` and `b`.

    Each end sets `on_message[end]` and `on_close[end]`; `send(end, payload)` queues a
    message to the other end. `close()` (one end hanging up) is seen by the other end after a
    link delay, or at the dead-connection timeout when the link is cut.
    """

    def __init__(self, network: Network, conn_id: int, a: str, b: str) -> None:
        self.net = network
        self.id = conn_id
        self.ends = (a, b)
        self.alive = True
        self.on_message: dict[str, Callable[[Any], None]] = {}
        self.on_close: dict[str, Callable[[], None]] = {}
        self._queues: dict[str, deque[tuple[float, Any]]] = {a: deque(), b: deque()}
        self._scheduled: dict[str, bool] = {a: False, b: False}
        self._stuck_since: dict[str, float | None] = {a: None, b: None}

    def peer(self, end: str) -> str:
        a, b = self.ends
        assert end in self.ends, (end, self.ends)
        return b if end == a else a

    def send(self, end: str, payload: Any) -> None:
        if not self.alive:
            return
        dst = self.peer(end)
        queue = self._queues[dst]
        due = self.net.sched.now + self.net.delay(end, dst)
        if queue:
            due = max(due, queue[-1][0])
        queue.append((due, payload))
        if not self._scheduled[dst]:
            self._scheduled[dst] = True
            self.net.sched.at(max(due, self.net.sched.now), self._deliver, dst)

    def _deliver(self, dst: str) -> None:
        self._scheduled[dst] = False
        if not self.alive:
            return
        net, now = self.net, self.net.sched.now
        src = self.peer(dst)
        queue = self._queues[dst]
        while queue and queue[0][0] <= now:
            if net.is_cut(src, dst):
                stuck = self._stuck_since[dst]
                if stuck is None:
                    stuck = self._stuck_since[dst] = now
                if now - stuck >= DEAD_AFTER_S:
                    self._die()
                    return
                self._schedule(dst, now + RETRANSMIT_S)
                return
            self._stuck_since[dst] = None
            ready = net.gates[dst]()
            if ready is None:  # the end crashed: a reset
                self._die()
                return
            if ready > now:
                self._schedule(dst, ready)
                return
            _, payload = queue.popleft()
            handler = self.on_message.get(dst)
            if handler is not None:
                handler(payload)
            if not self.alive:
                return
        if queue:
            self._schedule(dst, queue[0][0])

    def _schedule(self, dst: str, when: float) -> None:
        if not self._scheduled[dst]:
            self._scheduled[dst] = True
            self.net.sched.at(max(when, self.net.sched.now), self._deliver, dst)

    def close(self, end: str) -> None:
        """`end` hangs up (its side forgets the connection at once; the peer hears later)."""
        if not self.alive:
            return
        self.alive = False
        self.net.conns.pop(self.id, None)
        peer = self.peer(end)
        self.on_close.pop(end, None)
        wait = DEAD_AFTER_S if self.net.is_cut(end, peer) else self.net.delay(end, peer)
        self.net.sched.after(wait, self._tell, peer)

    def crash(self, end: str) -> None:
        """`end` crashed: its side is gone; the peer sees a reset (or, cut off, a timeout)."""
        self.close(end)

    def check_cut(self) -> None:
        a, b = self.ends
        if self.alive and (self.net.is_cut(a, b) or self.net.is_cut(b, a)):
            self._die()

    def _die(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.net.conns.pop(self.id, None)
        for end in self.ends:
            self._tell(end)

    def _tell(self, end: str) -> None:
        callback = self.on_close.pop(end, None)
        if callback is not None and self.net.gates[end]() is not None:
            ready = self.net.gates[end]()
            assert ready is not None
            if ready > self.net.sched.now:
                self.net.sched.at(ready, self._tell_late, callback)
                return
            callback()

    def _tell_late(self, callback: Callable[[], None]) -> None:
        callback()
