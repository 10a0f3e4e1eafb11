"""The node's one entry for a vbucket's state change (`ServerContext.set_vbucket_state`): each
effect of the edge happens in that call — durable writes waiting on a vbucket that stops being
active hear SYNC_WRITE_AMBIGUOUS in the same event-loop turn, not at their 10 s timeout."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from changefeed.protocol.errors import SyncWriteAmbiguousError
from changefeed.protocol.frame_info import DurabilityLevel, DurabilityRequirement
from changefeed.protocol.kv import StoreCommand
from changefeed.protocol.opcode import Opcode
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.context import ServerContext
from changefeed.server.replication import ReplicationTracker
from changefeed.server.sync_writes import SyncWriteMonitor
from changefeed.server.users import Users
from changefeed.vbucket_state import Effect, VBucketState
from support.buckets import ManualClock, open_bucket


def context_of(bucket: Bucket, path: Path) -> ServerContext:
    return ServerContext(NodeConfig(data_dir=path, vbuckets=4, durable=False), Users(), bucket)


@pytest.mark.parametrize("new", [VBucketState.REPLICA, VBucketState.DEAD, VBucketState.PENDING])
def test_a_durable_write_waiting_on_a_vbucket_that_stops_being_active_is_answered_at_once(
    tmp_path: Path, new: VBucketState
) -> None:
    async def scenario() -> None:
        with open_bucket(tmp_path, ManualClock()) as bucket:
            context = context_of(bucket, tmp_path)
            tracker = ReplicationTracker(
                lambda vb: bucket.vbucket(vb).high_seqno, lag_max_s=10.0, clock=lambda: 0.0
            )
            # One replica in the chain that never acks: the write can only wait.
            monitor = SyncWriteMonitor(bucket, replicas_of=lambda vb: ["r1"], replication=tracker)
            context.replication, context.sync_writes = tracker, monitor
            tracker.stream_opened(0, "r1", 0)
            command = StoreCommand(Opcode.SET, 0, 1, b"k", b"v")
            prepared = bucket.store_command(command, level=int(DurabilityLevel.MAJORITY))
            requirement = DurabilityRequirement(DurabilityLevel.MAJORITY)
            outcomes: list[object] = []
            monitor.track_run(requirement, [0], [b"k"], [prepared.seqno], [outcomes.append])
            assert outcomes == []

            edge = context.set_vbucket_state(0, new)

            assert edge is not None and Effect.WAITERS_AMBIGUOUS in edge.effects
            assert len(outcomes) == 1, "answered in the call, not at a later ack or the timeout"
            assert isinstance(outcomes[0], SyncWriteAmbiguousError)
            assert monitor.waiting_on(0) == 0
            assert monitor.stats.ambiguous_state == 1
            # The prepare stays with the vbucket: a promoted copy decides it.
            assert [p.key for p in bucket.vbucket(0).pending_prepares] == [b"k"]
            forgotten = Effect.REPLICA_PROGRESS_FORGOTTEN in edge.effects
            assert forgotten is (new is not VBucketState.PENDING)  # a fence keeps its replicas
            assert (tracker.in_sync_set(0) == []) is forgotten

    asyncio.run(scenario())


def test_promotion_adds_a_failover_entry_and_commits_held_prepares(tmp_path: Path) -> None:
    with open_bucket(tmp_path, ManualClock()) as bucket:
        context = context_of(bucket, tmp_path)
        vbucket = bucket.vbucket(1)
        context.set_vbucket_state(1, VBucketState.REPLICA)
        entries = len(vbucket.failover_log.entries)
        edge = context.set_vbucket_state(1, VBucketState.ACTIVE)
        assert edge is not None
        assert edge.effects == {Effect.NEW_FAILOVER_ENTRY, Effect.PREPARES_COMMITTED}
        assert len(vbucket.failover_log.entries) == entries + 1
        assert vbucket.failover_log.latest[1] == vbucket.high_seqno
        assert context.set_vbucket_state(1, VBucketState.ACTIVE) is None  # no edge to itself
