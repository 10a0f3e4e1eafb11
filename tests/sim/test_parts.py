"""The simulator's own parts: the metadata store's leases and fenced transactions, the
network's cuts and ordered connections, the scheduler's order."""

from __future__ import annotations

from .metastore import MetaStore
from .network import DEAD_AFTER_S, Network
from .scheduler import Scheduler


def _store() -> tuple[Scheduler, MetaStore]:
    sched = Scheduler(1)
    net = Network(sched)
    return sched, MetaStore(sched, net)


def test_a_lease_expires_by_the_simulated_clock_and_takes_its_keys() -> None:
    sched, meta = _store()
    lease = meta.grant(2)
    assert meta.put("nodes/n0", "n0", lease) is not None
    sched.run_until(1.5)
    assert meta.keep_alive(lease) == 2  # renewed to a full TTL from now
    sched.run_until(3.4)
    assert meta.get("nodes/n0") is not None
    sched.run_until(3.6)
    assert meta.get("nodes/n0") is None
    assert meta.keep_alive(lease) == 0
    assert meta.put("status/n0", {}, lease) is None  # a dead lease refuses puts


def test_a_map_write_is_fenced_by_the_leader_key_and_the_map_revision() -> None:
    _, meta = _store()
    lease = meta.grant(5)
    won, token = meta.txn([("create", "leader", 0)], [("put", "leader", "n0", lease)], [])
    assert won and token
    assert not meta.txn([("create", "leader", 0)], [("put", "leader", "n1", lease)], [])[0]
    ok, _ = meta.txn([("mod", "map", 0), ("create", "leader", token)], [("put", "map", 1, 0)], [])
    assert ok
    map_rev = meta.get("map").mod_revision  # type: ignore[union-attr]
    stale = [("mod", "map", map_rev - 1), ("create", "leader", token)]
    assert not meta.txn(stale, [("put", "map", 2, 0)], [])[0]
    meta.revoke(lease)  # the leader's lease gone: a new leader has another create revision
    assert meta.get("leader") is None
    fenced = [("mod", "map", map_rev), ("create", "leader", token)]
    assert not meta.txn(fenced, [("put", "map", 3, 0)], [])[0]


def test_a_connection_holds_order_and_dies_when_cut_too_long() -> None:
    sched = Scheduler(2)
    net = Network(sched)
    for name in ("a", "b"):
        net.register(name, lambda: sched.now)
    conn = net.connect("a", "b")
    got: list[int] = []
    closed: list[str] = []
    conn.on_message["b"] = got.append
    conn.on_close["a"] = lambda: closed.append("a")
    conn.on_close["b"] = lambda: closed.append("b")
    for i in range(20):
        conn.send("a", i)
    sched.run_until(0.1)
    assert got == list(range(20))
    net.faults.cut[("a", "b")] += 1
    net.cut_changed()
    conn.send("a", 20)
    sched.run_until(1.0)
    assert got[-1] == 19 and conn.alive  # held, as TCP retransmits
    del net.faults.cut[("a", "b")]
    sched.run_until(1.5)
    assert got[-1] == 20
    net.faults.cut[("a", "b")] += 1
    net.cut_changed()
    sched.run_until(2.0 + DEAD_AFTER_S)
    assert not conn.alive
    assert sorted(closed) == ["a", "b"]


def test_datagrams_are_lost_across_a_cut_and_events_run_in_order() -> None:
    sched = Scheduler(3)
    net = Network(sched)
    for name in ("a", "b"):
        net.register(name, lambda: sched.now)
    got: list[str] = []
    net.faults.cut[("a", "b")] += 1
    net.send("a", "b", got.append, "lost")
    net.send("b", "a", got.append, "kept")
    sched.run_until(1.0)
    assert got == ["kept"]
    order: list[int] = []
    for i in range(5):
        sched.at(2.0, order.append, i)
    sched.run_until(2.0)
    assert order == [0, 1, 2, 3, 4]
