"""The vbucket state table (`vbucket_state.TRANSITIONS`) against the rules it encodes."""

from __future__ import annotations

import pytest

from changefeed.vbucket_state import (
    TRANSITIONS,
    Effect,
    IllegalTransitionError,
    VBucketState,
    transition,
)

A, R, P, D = VBucketState.ACTIVE, VBucketState.REPLICA, VBucketState.PENDING, VBucketState.DEAD


def test_every_change_between_two_states_is_an_edge_and_no_state_changes_to_itself() -> None:
    assert len(TRANSITIONS) == 4 * 3
    for state in VBucketState:
        with pytest.raises(IllegalTransitionError, match=state.value):
            transition(state, state)


@pytest.mark.parametrize(("old", "new"), sorted(TRANSITIONS, key=str))
def test_each_edge_has_the_effects_of_its_rule(old: VBucketState, new: VBucketState) -> None:
    effects = transition(old, new).effects
    # Becoming active is a new history branch and decides the prepares it holds.
    assert (Effect.NEW_FAILOVER_ENTRY in effects) is (new is A)
    assert (Effect.PREPARES_COMMITTED in effects) is (new is A)
    # Leaving active answers its durable-write waiters and drops its locks.
    assert (Effect.WAITERS_AMBIGUOUS in effects) is (old is A or (old is P and new in (R, D)))
    assert (Effect.LOCKS_DROPPED in effects) is (Effect.WAITERS_AMBIGUOUS in effects)
    # Streams end (and replica progress is forgotten) only when the copy really leaves:
    # ACTIVE <-> PENDING is a takeover's fence, whose streams must carry on.
    leaves = old in (A, P) and new in (R, D)
    assert (Effect.STREAMS_ENDED in effects) is leaves
    assert (Effect.REPLICA_PROGRESS_FORGOTTEN in effects) is leaves
