"""Members registered since their in-sync record (`cluster.rules.promotable_members`,
`registered_since`, `InSyncKeeper.target`'s `reregistered`), against simple models.

The safety property: the orchestrator never promotes, from a record, a member whose current
process registered after the record was written (it may have restarted and lost what it
acknowledged from memory). The liveness property: once such a member is caught up on a stream
of its current process, the active writes a record naming it, so it is promotable again.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.cluster.rules import InSyncKeeper, promotable_members, registered_since

NAMES = ("a", "b", "c", "d")

registrations = st.dictionaries(st.sampled_from(NAMES), st.integers(1, 40))


@settings(max_examples=300)
@given(
    members=st.frozensets(st.sampled_from(NAMES)),
    record_revision=st.integers(1, 40),
    registered=registrations,
)
def test_promotable_are_the_members_registered_before_the_record(
    members: frozenset[str], record_revision: int, registered: dict[str, int]
) -> None:
    promotable = promotable_members(members, record_revision, registered)
    since = registered_since(members, record_revision, registered)
    for name in NAMES:
        before = name in registered and registered[name] < record_revision
        assert (name in promotable) == (name in members and before), name
        after = name in registered and registered[name] > record_revision
        assert (name in since) == (name in members and after), name
    assert not promotable & since


def test_a_member_restarted_within_its_lease_is_not_promotable() -> None:
    """Seed 8805's shape: the record (revision 10) names n0; n0 restarts and registers again
    (its key put anew, mod revision 12, even if its old lease still ran): not promotable."""
    assert promotable_members({"n0"}, 10, {"n0": 5}) == {"n0"}
    assert promotable_members({"n0"}, 10, {"n0": 12}) == frozenset()
    assert registered_since({"n0"}, 10, {"n0": 12}) == {"n0"}
    assert promotable_members({"n0"}, 10, {}) == frozenset()  # not registered: not live


def test_the_keeper_rewrites_its_record_once_a_reregistered_member_caught_up() -> None:
    keeper = InSyncKeeper(frozenset({"b", "c"}))
    members = keeper.target(frozenset({"b", "c"}), frozenset({"b", "c"}))
    assert members == {"b", "c"}
    keeper.begin(members)
    keeper.written(members, revision=10)
    assert keeper.revision == 10
    # b registers again (revision 12): nothing to write while it is not caught up...
    assert keeper.target(frozenset({"b", "c"}), frozenset({"c"}), frozenset({"b"})) is None
    # ...and once it is, the same record is written again (a newer revision).
    again = keeper.target(frozenset({"b", "c"}), frozenset({"b", "c"}), frozenset({"b"}))
    assert again == {"b", "c"}
    keeper.begin(again)
    keeper.written(again, revision=15)
    assert keeper.target(frozenset({"b", "c"}), frozenset({"b", "c"})) is None


def test_a_record_written_for_another_reason_leaves_out_a_reregistered_member_behind() -> None:
    keeper = InSyncKeeper(frozenset({"b", "c", "d"}))
    first = keeper.target(frozenset({"b", "c"}), frozenset({"b", "c"}))
    assert first is not None
    keeper.begin(first)
    keeper.written(first, revision=10)
    # d joins (caught up) while b, registered again, is not caught up: the record written
    # for d must not name b (its new revision would vouch for b).
    grown = keeper.target(frozenset({"b", "c", "d"}), frozenset({"c", "d"}), frozenset({"b"}))
    assert grown == {"c", "d"}


# The model of the keeper's records against registrations: a sequence of events on one
# vbucket; the etcd revision rises with every write (record or registration).
events = st.lists(
    st.one_of(
        st.tuples(st.just("register"), st.sampled_from(NAMES[1:])),  # a restart or lost lease
        st.tuples(st.just("catch_up"), st.sampled_from(NAMES[1:])),  # on its current process
        st.tuples(st.just("fall_behind"), st.sampled_from(NAMES[1:])),
        st.tuples(st.just("record"), st.booleans()),  # written (True) or refused
    ),
    max_size=50,
)


@settings(max_examples=400)
@given(events=events)
def test_a_record_never_vouches_for_a_process_that_did_not_catch_up_and_catching_up_is_enough(
    events: list[tuple[str, object]],
) -> None:
    replicas = frozenset(NAMES[1:])
    keeper = InSyncKeeper(replicas)
    revision = 1
    registered = dict.fromkeys(replicas, 1)
    # replica -> the registration (process) it last caught up as: that process holds every
    # write up to then, and commits need its acks while a record names it
    caught_up_process: dict[str, int] = {}
    behind: set[str] = set()  # caught up once, not now (no longer acking the high seqno)
    record: tuple[frozenset[str], int] | None = None
    for kind, arg in events:
        if kind == "register":
            revision += 1
            registered[str(arg)] = revision
        elif kind == "catch_up":
            caught_up_process[str(arg)] = registered[str(arg)]
            behind.discard(str(arg))
        elif kind == "fall_behind":
            behind.add(str(arg))
        else:
            caught_up = frozenset(
                r
                for r, reg in caught_up_process.items()
                if reg == registered[r] and r not in behind
            )
            members = keeper.target(replicas, caught_up, keeper.registered_since(registered))
            if members is None:
                continue
            keeper.begin(members)
            if arg:
                revision += 1
                keeper.written(members, revision)
                record = (members, revision)
            else:
                keeper.failed()
        if record is None:
            continue
        members, at = record
        # Safety: whoever the record makes promotable caught up as the process registered now.
        for name in promotable_members(members, at, registered):
            assert caught_up_process.get(name) == registered[name], (name, record, registered)
    # Liveness: with every replica caught up as its current process, a record or two later
    # each is promotable.
    for name in replicas:
        caught_up_process[name] = registered[name]
    behind.clear()
    for _ in range(2):
        members = keeper.target(replicas, replicas, keeper.registered_since(registered))
        if members is None:
            break
        keeper.begin(members)
        revision += 1
        keeper.written(members, revision)
        record = (members, revision)
    assert record is not None
    assert promotable_members(record[0], record[1], registered) == replicas
