"""The states a vbucket can be in, as one enum every layer shares.

It sits low, beside `failover` and above `protocol` (whose wire values it maps), because the
store persists a vbucket's state, the producer decides stream requests by it and the server
filters seqno lists by it: all of them compare enum members, never strings. The values are the
words the store keeps and that Couchbase prints (dcp-wire.md §7.11); a `StrEnum`, so JSON and
stats need no conversion.
"""

from __future__ import annotations

import dataclasses
import enum

from changefeed.protocol.dcp import WireVbucketState


class VBucketState(enum.StrEnum):
    """active: takes writes; replica: fed by the active; pending: taking over; dead: gone."""

    ACTIVE = "active"
    REPLICA = "replica"
    PENDING = "pending"
    DEAD = "dead"

    @property
    def is_active(self) -> bool:
        """Takes writes and reads, owns locks and durable writes (the one copy in the map)."""
        return self is VBucketState.ACTIVE

    @property
    def is_replica(self) -> bool:
        """A copy fed by its active, serving replica reads."""
        return self is VBucketState.REPLICA

    @property
    def holds_copy(self) -> bool:
        """Holds the vbucket's data (everything but DEAD)."""
        return self is not VBucketState.DEAD

    @property
    def streamable(self) -> bool:
        """True if a DCP stream may be opened on it (active and replica, dcp-wire.md §6.2)."""
        return self in (VBucketState.ACTIVE, VBucketState.REPLICA)


def initial_state(*, clustered: bool) -> VBucketState:
    """The state of a vbucket a node's store does not know yet: alone, a node owns every
    vbucket (ACTIVE); in a cluster a vbucket waits, DEAD, for the map to give it a state."""
    return VBucketState.DEAD if clustered else VBucketState.ACTIVE


# The wire's vbucket_state_t values (GET_ALL_VB_SEQNOS filter, SET_VBUCKET_STATE): 1 active ..
STATE_BY_WIRE_VALUE = {int(wire): VBucketState(wire.name.lower()) for wire in WireVbucketState}
assert set(STATE_BY_WIRE_VALUE.values()) == set(VBucketState), STATE_BY_WIRE_VALUE


class Effect(enum.Enum):
    """What one state change does, named so that each has one owner and one test.

    The vbucket performs its own (`VBucket.set_state`); the node fans the rest out
    (`ServerContext.set_vbucket_state`). Nothing else changes a vbucket's state.
    """

    # -- performed by the vbucket --
    NEW_FAILOVER_ENTRY = "new_failover_entry"  # a new history branch at the high seqno
    LOCKS_DROPPED = "locks_dropped"  # GET_LOCKED locks live on the active copy only
    PREPARES_COMMITTED = "prepares_committed"  # a promoted copy commits what it holds
    # -- fanned out by the node --
    WAITERS_AMBIGUOUS = "waiters_ambiguous"  # durable writes waiting here: SYNC_WRITE_AMBIGUOUS
    STREAMS_ENDED = "streams_ended"  # STREAM_END STATE_CHANGED: consumers follow the map
    REPLICA_PROGRESS_FORGOTTEN = "replica_progress_forgotten"  # replicas report elsewhere now


_OWNED = (VBucketState.ACTIVE, VBucketState.PENDING)


@dataclasses.dataclass(frozen=True, slots=True)
class Transition:
    """One edge of the table: `old` → `new` and its effects."""

    old: VBucketState
    new: VBucketState
    effects: frozenset[Effect]


class IllegalTransitionError(ValueError):
    """A state change the table does not allow (a bug in the caller, never a client's)."""


def _effects(old: VBucketState, new: VBucketState) -> frozenset[Effect]:
    effects: set[Effect] = set()
    if new is VBucketState.ACTIVE:
        # PENDING -> ACTIVE (an aborted takeover) branches too: writes the fenced copy's
        # successor may have taken are another history.
        effects |= {Effect.NEW_FAILOVER_ENTRY, Effect.PREPARES_COMMITTED}
    if old is VBucketState.ACTIVE:
        # Takeover's fence (ACTIVE -> PENDING) included: the successor decides the prepares.
        effects |= {Effect.LOCKS_DROPPED, Effect.WAITERS_AMBIGUOUS}
    if old in _OWNED and new not in _OWNED:
        # ACTIVE <-> PENDING keeps streams: the new copies must receive all the fenced copy
        # acknowledged; they end when the vbucket really leaves.
        effects |= {
            Effect.LOCKS_DROPPED,
            Effect.WAITERS_AMBIGUOUS,
            Effect.STREAMS_ENDED,
            Effect.REPLICA_PROGRESS_FORGOTTEN,
        }
    return frozenset(effects)


# Every change between two different states is legal: after a crash, a failover or a
# rebalance the map may put a copy in any state. A copy's state never "changes" to itself.
TRANSITIONS: dict[tuple[VBucketState, VBucketState], Transition] = {
    (old, new): Transition(old, new, _effects(old, new))
    for old in VBucketState
    for new in VBucketState
    if old is not new
}


def transition(old: VBucketState, new: VBucketState) -> Transition:
    """The table's edge from `old` to `new`.

    Raises:
        IllegalTransitionError: `old` is `new`, or the edge is not in the table.
    """
    found = TRANSITIONS.get((old, new))
    if found is None:
        raise IllegalTransitionError(f"vbucket state {old.value} cannot become {new.value}")
    return found
