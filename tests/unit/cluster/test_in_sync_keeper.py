"""The confirmed in-sync record (`cluster.rules.InSyncKeeper`) with the commit rule
(`sync_writes.durability_met`), against the safety property they exist for:

    every replica named by any record that is, or may be, in etcd holds every committed write

— so whichever member the orchestrator promotes, no acknowledged durable write is lost.
Random schedules of writes, acks, in-sync changes and record writes that succeed, fail, or
time out having (or not having) reached etcd.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.cluster.rules import InSyncKeeper
from changefeed.server.sync_writes import durability_met

REPLICAS = ("b", "c", "d")

steps = st.lists(
    st.one_of(
        st.tuples(st.just("write")),
        st.tuples(st.just("ack"), st.sampled_from(REPLICAS), st.integers(0, 3)),
        st.tuples(st.just("leave"), st.sampled_from(REPLICAS)),
        st.tuples(st.just("join"), st.sampled_from(REPLICAS)),
        st.tuples(st.just("record"), st.sampled_from(["ok", "refused", "lost", "landed"])),
    ),
    max_size=60,
)


@settings(max_examples=400)
@given(steps=steps, chain=st.integers(1, 3))
def test_every_possible_record_member_holds_every_commit(
    steps: list[tuple[object, ...]], chain: int
) -> None:
    replicas = REPLICAS[:chain]
    keeper = InSyncKeeper(frozenset(replicas))
    high = 0
    acked = dict.fromkeys(replicas, 0)
    in_sync = set(replicas)
    pending: list[int] = []
    committed: list[int] = []
    # Records that may be in etcd now: the last one known written, and any whose write's
    # outcome is unknown (etcd may have applied it).
    possible: list[frozenset[str]] = []
    for step in steps:
        kind = step[0]
        if kind == "write":
            high += 1
            pending.append(high)
        elif kind == "ack":
            replica, gain = str(step[1]), int(step[2])  # type: ignore[call-overload]
            if replica in in_sync and replica in acked:
                acked[replica] = min(high, acked[replica] + gain)
        elif kind == "leave":
            in_sync.discard(str(step[1]))
        elif kind == "join" and step[1] in replicas:
            in_sync.add(str(step[1]))
        elif kind == "record":
            sync = frozenset(r for r in replicas if r in in_sync)
            caught_up = frozenset(r for r in sync if acked[r] >= high)
            members = keeper.target(sync, caught_up)
            if members is None:
                continue
            keeper.begin(members)
            outcome = step[1]
            if outcome == "ok":
                keeper.written(members)
                possible = [members]
            elif outcome == "landed":  # timed out, but etcd applied it
                keeper.failed()
                possible.append(members)
            elif outcome == "lost":  # timed out and never applied
                keeper.failed()
            else:  # the map moved on: refused by the fence
                keeper.failed()
        # The monitor: commit what the rule allows (the active persists at once here).
        for seqno in list(pending):
            replica_acks = [acked[r] for r in replicas]
            required = [acked[r] for r in keeper.required]
            if durability_met(seqno, high, replica_acks, required):
                pending.remove(seqno)
                committed.append(seqno)
        # The property: any member of any possible record holds every commit.
        for record in possible:
            for member in record:
                assert all(acked[member] >= seqno for seqno in committed), (
                    record,
                    member,
                    acked,
                    committed,
                )
        assert keeper.confirmed is None or keeper.confirmed <= keeper.required


def test_a_leaver_is_released_only_after_the_record_without_it_is_written() -> None:
    keeper = InSyncKeeper(frozenset({"b", "c"}))
    members = keeper.target(frozenset({"b", "c"}), frozenset({"b", "c"}))
    assert members == {"b", "c"}
    keeper.begin(members)
    keeper.written(members)
    shrink = keeper.target(frozenset({"b"}), frozenset({"b"}))
    assert shrink == {"b"}
    keeper.begin(shrink)
    assert keeper.required == {"b", "c"}, "still required while the write is in flight"
    keeper.written(shrink)
    assert keeper.required == {"b"}


def test_a_newcomer_joins_only_when_caught_up_and_is_required_before_the_write() -> None:
    keeper = InSyncKeeper(frozenset())
    assert keeper.target(frozenset({"b"}), frozenset()) == frozenset()  # in sync, not caught up
    keeper.begin(frozenset())
    keeper.written(frozenset())
    assert keeper.target(frozenset({"b"}), frozenset()) is None
    grow = keeper.target(frozenset({"b"}), frozenset({"b"}))
    assert grow == {"b"}
    keeper.begin(grow)
    assert keeper.required == {"b"}
