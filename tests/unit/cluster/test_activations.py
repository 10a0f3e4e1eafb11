"""Activations decided on an earlier process (issue 25's crash race): `rules.refuses_activation`,
`rules.copy_holds_its_branch`, `metadata.activations_of` and `plan_failover`'s `refusals`,
against simple models.

The safety property: a node takes a vbucket as active only on an activation decided on its
current process (the orchestrator judged that registration), or when its own disk holds
everything its earlier process acknowledged. The orchestrator then answers a refusal by
promoting another member of the record, never the node that refused.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.cluster.failover import InSyncRecord, plan_failover
from changefeed.cluster.metadata import Activation, StoredMap, activations_of
from changefeed.cluster.rules import copy_holds_its_branch, recovered_state, refuses_activation
from changefeed.failover import FailoverLog
from changefeed.vbmap import ClusterMap, NodeAddress
from changefeed.vbucket_state import VBucketState

NAMES = ("n0", "n1", "n2")
NODES = tuple(NodeAddress(n, "127.0.0.1", 1000 + i) for i, n in enumerate(NAMES))


@settings(max_examples=100)
@given(
    judged=st.one_of(st.none(), st.integers(1, 50)),
    map_revision=st.integers(1, 50),
    registration=st.integers(1, 50),
    holds_branch=st.booleans(),
)
def test_an_activation_is_refused_only_when_decided_on_an_earlier_process(
    judged: int | None, map_revision: int, registration: int, holds_branch: bool
) -> None:
    decided = judged if judged is not None else map_revision
    refused = refuses_activation(judged, map_revision, registration, holds_branch=holds_branch)
    assert refused == (decided < registration and not holds_branch)


def test_the_crash_race_is_refused_and_a_restart_of_a_caught_up_active_is_not() -> None:
    # Promoted on registration 7 while dead; its next process registered at 12.
    assert refuses_activation(7, 10, 12, holds_branch=False)
    # The same decision, but the copy's disk holds its branch: it stays active.
    assert not refuses_activation(7, 10, 12, holds_branch=True)
    # A later process of the same registration (its lease lost and taken again): stands.
    assert not refuses_activation(12, 10, 12, holds_branch=False)
    # No activation stored with the map: the map's own revision stands for it.
    assert refuses_activation(None, 10, 12, holds_branch=False)
    assert not refuses_activation(None, 13, 12, holds_branch=False)


@settings(max_examples=100)
@given(state=st.sampled_from(VBucketState), clean=st.booleans(), lost=st.booleans())
def test_a_copy_holds_its_branch_only_if_it_was_active_and_kept_the_branch_start(
    state: VBucketState, clean: bool, lost: bool
) -> None:
    holds = copy_holds_its_branch(state, clean, lost)
    if state is VBucketState.ACTIVE:
        assert holds == (clean or not lost)
    elif state is VBucketState.PENDING:
        # Taken by a process (a fenced active, a promotion while fenced): a clean stop kept
        # all it held; after a crash it may be a promoted replica that acked from memory.
        assert holds == clean
    else:
        assert not holds  # a replica acknowledged from memory; even a clean stop is refused
    # What a start stores: a copy not vouched for waits as a replica, never PENDING.
    recovered = recovered_state(state, holds_branch=holds)
    if state in (VBucketState.ACTIVE, VBucketState.PENDING):
        assert recovered is (VBucketState.PENDING if holds else VBucketState.REPLICA)
    else:
        assert recovered is state


@settings(max_examples=100)
@given(
    seqnos=st.lists(st.integers(0, 100), min_size=1, max_size=8, unique=True),
    high=st.integers(0, 100),
)
def test_a_new_entry_reports_the_entries_above_it_it_dropped(seqnos: list[int], high: int) -> None:
    entries = [(i + 1, seqno) for i, seqno in enumerate(sorted(seqnos, reverse=True))]
    log = FailoverLog(entries, rng=random.Random(0))
    assert log.dropped_above == ()
    log.create_entry(high)
    assert log.dropped_above == tuple(e for e in entries if e[1] > high)
    assert not set(log.dropped_above) & set(log.entries)


def _map(rev: int, chains: tuple[tuple[int, ...], ...]) -> ClusterMap:
    return ClusterMap(rev, NODES, chains, 2)


chains = st.lists(st.permutations([0, 1, 2]).map(tuple), min_size=1, max_size=6)


@settings(max_examples=60)
@given(
    before=chains,
    after_chains=chains,
    registered=st.dictionaries(st.sampled_from(NAMES), st.integers(1, 50)),
    kept_registration=st.integers(1, 50),
)
def test_activations_carry_over_while_the_active_stays_and_are_judged_anew_when_it_changes(
    before: list[tuple[int, ...]],
    after_chains: list[tuple[int, ...]],
    registered: dict[str, int],
    kept_registration: int,
) -> None:
    n = min(len(before), len(after_chains))
    old = _map(1, tuple(before[:n]))
    new = _map(2, tuple(after_chains[:n]))
    stored_activations = {
        vb: Activation(NAMES[old.chains[vb][0]], kept_registration) for vb in range(n)
    }
    stored = StoredMap(old, 5, stored_activations)
    activations, judged = activations_of(new, stored, registered)
    for vb in range(n):
        active = NAMES[new.chains[vb][0]]
        if old.chains[vb][0] == new.chains[vb][0]:
            assert activations[vb] == stored_activations[vb]
        else:
            assert activations[vb] == Activation(active, registered.get(active, 0))
            if active in registered:
                assert judged[active] == registered[active]
    first, _ = activations_of(new, None, registered)
    assert all(first[vb].registration == registered.get(first[vb].node, 0) for vb in range(n))


def test_a_refused_vbucket_goes_to_a_promotable_member_of_the_record_never_back() -> None:
    """n1 led vb 0 (record: n2, n0); n2 was promoted while dead and refused it on restart.
    The record is n1's (n2 wrote none): n0, a member, is promoted; n2 stays a replica."""
    current = _map(2, ((2, 0, 1),))
    record = {0: InSyncRecord("n1", frozenset({"n0"}))}  # n2 filtered out: registered since
    highs = {"n0": {0: 10}, "n2": {0: 12}}
    plan = plan_failover(current, {"n0", "n2"}, record, highs, refusals={0: "n2"})
    assert plan.promoted == {0: "n0"}
    assert plan.new_map is not None and plan.new_map.chains[0][0] == 0
    assert 2 in plan.new_map.chains[0][1:]
    assert not plan.reinstated
    # Without a promotable member, the active that wrote the record gets it back when live
    # (its commits were persisted first; its own disk decides, on the record's revision)...
    back = plan_failover(
        current, {"n0", "n1", "n2"}, {0: InSyncRecord("n1", frozenset())}, highs,
        refusals={0: "n2"},
    )  # fmt: skip
    assert back.promoted == {0: "n1"} and back.reinstated == {0: "n1"}
    # ...else the vbucket waits where it is, and says why.
    waiting = plan_failover(
        current, {"n0", "n2"}, {0: InSyncRecord("n1", frozenset())}, highs, refusals={0: "n2"}
    )
    assert waiting.new_map is None and "n2 declined it" in waiting.refused[0]
    assert not waiting.reinstated
    # A request from a node that is not the vbucket's active changes nothing.
    assert plan_failover(current, {"n0", "n2"}, record, highs, refusals={0: "n0"}).new_map is None


def test_a_declined_vbucket_with_no_record_goes_to_a_live_replica() -> None:
    """A fresh cluster: n1, made vb 0's active by the first map, restarted before applying it
    and declined (its new empty copy is DEAD). No active ever wrote a record, so none could
    commit without every placed replica: a live one takes the vbucket (it waited forever)."""
    current = _map(1, ((1, 0, 2),))
    plan = plan_failover(current, {"n0", "n1", "n2"}, {}, {}, refusals={0: "n1"})
    assert plan.new_map is not None, plan.refused
    assert plan.promoted[0] in {"n0", "n2"} and not plan.reinstated
    assert plan.new_map.chains[0][-1] == 1  # the decliner stays, as a replica
    # Without a refusal, a dead active with no record still waits (nothing says who holds what).
    assert plan_failover(current, {"n0", "n2"}, {}, {}).promoted == {}
