"""The states a vbucket can be in, as one enum every layer shares.

It sits low, beside `failover` and above `protocol` (whose wire values it maps), because the
store persists a vbucket's state, the producer decides stream requests by it and the server
filters seqno lists by it: all of them compare enum members, never strings. The values are the
words the store keeps and that Couchbase prints (dcp-wire.md §7.11); a `StrEnum`, so JSON and
stats need no conversion.
"""

from __future__ import annotations

import enum

from changefeed.protocol.dcp import WireVbucketState


class VBucketState(enum.StrEnum):
    """active: takes writes; replica: fed by the active; pending: taking over; dead: gone."""

    ACTIVE = "active"
    REPLICA = "replica"
    PENDING = "pending"
    DEAD = "dead"

    @property
    def streamable(self) -> bool:
        """True if a DCP stream may be opened on it (active and replica, dcp-wire.md §6.2)."""
        return self in (VBucketState.ACTIVE, VBucketState.REPLICA)


# The wire's vbucket_state_t values (GET_ALL_VB_SEQNOS filter, SET_VBUCKET_STATE): 1 active ..
STATE_BY_WIRE_VALUE = {int(wire): VBucketState(wire.name.lower()) for wire in WireVbucketState}
assert set(STATE_BY_WIRE_VALUE.values()) == set(VBucketState), STATE_BY_WIRE_VALUE
