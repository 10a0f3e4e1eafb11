"""A vbucket and the roles its states give it.

`core.VBucket` is the vbucket (seqnos, CAS clock, failover log, checkpoint manager, store); it
owns one role and swaps it on each state change: `active.ActiveRole` (writes, locks, the active
side of durability), `replica.ReplicaRole` (replicated runs, snapshots, rollback, the passive
side of durability; pending copies too) and `dead.DeadRole` (refuses). Roles reach the vbucket
through `port.VBucketCore` and never import `core`. `values` holds what they hand out.
"""

from changefeed.protocol.kv import MutationResult
from changefeed.vbucket.core import VBucket
from changefeed.vbucket.values import (
    Document,
    ReplicatedColumns,
    RunLookup,
    SetColumns,
    SetManyResult,
    fields_in_range,
)
from changefeed.vbucket_state import VBucketState

__all__ = [
    "Document",
    "MutationResult",
    "ReplicatedColumns",
    "RunLookup",
    "SetColumns",
    "SetManyResult",
    "VBucket",
    "VBucketState",
    "fields_in_range",
]
