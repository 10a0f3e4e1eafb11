"""The commit rule (`sync_writes.durability_met`) against a model: a prepare commits iff the
active persisted it and, counting the active, more than half of the chain's copies hold it."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from changefeed.server.sync_writes import durability_met


@given(
    seqno=st.integers(1, 20),
    active_persisted=st.integers(0, 20),
    acks=st.lists(st.integers(0, 20), max_size=3),
)
def test_commit_rule_matches_the_model(seqno: int, active_persisted: int, acks: list[int]) -> None:
    copies_holding = [active_persisted >= seqno] + [a >= seqno for a in acks]
    model = copies_holding[0] and sum(copies_holding) * 2 > len(copies_holding)
    assert durability_met(seqno, active_persisted, acks) is model


def test_two_commits_of_one_chain_always_share_a_copy() -> None:
    # The safety argument in one line: any two sets the rule accepts intersect, so a
    # promoted copy chosen from a majority always holds every committed prepare.
    for size in range(1, 5):
        accepted = [
            set(held)
            for r in range(size + 1)
            for held in itertools.combinations(range(size), r)
            if 0 in held and durability_met(1, 1, [1 if i in held else 0 for i in range(1, size)])
        ]
        assert all(a & b for a in accepted for b in accepted), size


def test_an_unpersisted_active_never_commits() -> None:
    assert not durability_met(5, 4, [9, 9])
    assert durability_met(5, 5, [9, 0])
    assert not durability_met(5, 5, [4, 0])


@given(
    seqno=st.integers(1, 20),
    active_persisted=st.integers(0, 20),
    acks=st.lists(st.integers(0, 20), max_size=4),
    required=st.lists(st.integers(0, 20), max_size=3),
)
def test_commit_rule_with_required_replicas_matches_the_model(
    seqno: int, active_persisted: int, acks: list[int], required: list[int]
) -> None:
    """Every replica of the confirmed in-sync record must hold the prepare too."""
    copies_holding = [active_persisted >= seqno] + [a >= seqno for a in acks]
    model = (
        copies_holding[0]
        and sum(copies_holding) * 2 > len(copies_holding)
        and all(r >= seqno for r in required)
    )
    assert durability_met(seqno, active_persisted, acks, required) is model
