"""Which role serves which state: the one place a state picks its behaviour."""

from __future__ import annotations

from changefeed.checkpoint import SyncItem
from changefeed.vbucket.active import ActiveRole
from changefeed.vbucket.dead import DeadRole
from changefeed.vbucket.port import VBucketCore
from changefeed.vbucket.replica import ReplicaRole
from changefeed.vbucket.role import Role
from changefeed.vbucket_state import VBucketState

# A pending copy takes replicated items while its takeover runs, as a replica does.
ROLE_OF: dict[VBucketState, type[Role]] = {
    VBucketState.ACTIVE: ActiveRole,
    VBucketState.REPLICA: ReplicaRole,
    VBucketState.PENDING: ReplicaRole,
    VBucketState.DEAD: DeadRole,
}
assert set(ROLE_OF) == set(VBucketState), ROLE_OF


def role_for(state: VBucketState, core: VBucketCore, pending: dict[bytes, SyncItem]) -> Role:
    """A new role serving `state` for `core`, taking over `pending`."""
    return ROLE_OF[state](core, pending)


def serves(role: Role, state: VBucketState) -> bool:
    """True if `role` is the one `state` gets (the vbucket's paired check after a swap)."""
    return type(role) is ROLE_OF[state]
