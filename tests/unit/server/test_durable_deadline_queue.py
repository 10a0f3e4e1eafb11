"""SyncWriteMonitor's deadline queues: every durable write still waiting keeps its deadline
(it times out, answered SYNC_WRITE_AMBIGUOUS exactly once), and a write answered before its
timeout leaves the queue at the queue's next new deadline instead of staying until its timeout
(a busy node would hold every answered write of the last timeout's length).

The timeouts are tens of milliseconds of the real event loop; nothing asserts on time: the test
sleeps past the last deadline (the loop runs timers in deadline order) and checks outcomes."""

from __future__ import annotations

import asyncio
from pathlib import Path

from changefeed.protocol.errors import SyncWriteAmbiguousError
from changefeed.protocol.frame_info import DurabilityLevel, DurabilityRequirement
from changefeed.protocol.kv import MutationResult, StoreCommand
from changefeed.protocol.opcode import Opcode
from changefeed.server.replication import ReplicationTracker
from changefeed.server.sync_writes import SyncWriteMonitor
from support.buckets import ManualClock, open_bucket

MAJORITY = DurabilityRequirement(DurabilityLevel.MAJORITY, timeout_ms=50)
NEVER_TIMES_OUT = DurabilityRequirement(DurabilityLevel.MAJORITY, timeout_ms=600_000)


def test_every_write_still_waiting_times_out_once(tmp_path: Path) -> None:
    """Three writes, each its own run, wait on a replica that never acknowledges: each new
    deadline looks at the queue's head (still waiting: kept), and all three time out."""

    async def scenario() -> None:
        with open_bucket(tmp_path, ManualClock()) as bucket:
            tracker = ReplicationTracker(
                lambda vb: bucket.vbucket(vb).high_seqno, lag_max_s=10.0, clock=lambda: 0.0
            )
            tracker.stream_opened(0, "r1", 0)  # reachable, never acknowledges
            monitor = SyncWriteMonitor(bucket, replicas_of=lambda vb: ["r1"], replication=tracker)
            outcomes: dict[bytes, list[object]] = {}
            for key in (b"a", b"b", b"c"):  # one run each: three deadlines in one queue
                prepared = bucket.store_command(
                    StoreCommand(Opcode.SET, 0, 1, key, b"v"), level=int(DurabilityLevel.MAJORITY)
                )
                outcomes[key] = []
                monitor.track_run(MAJORITY, [0], [key], [prepared.seqno], [outcomes[key].append])
            assert monitor.deadlines_queued == 3  # none answered: none dropped
            await asyncio.sleep(0.25)  # past the last deadline: its timer runs first
            for key, got in outcomes.items():
                assert len(got) == 1, (key, got)
                assert isinstance(got[0], SyncWriteAmbiguousError), (key, got)
            assert monitor.pending_count == 0
            assert monitor.deadlines_queued == 0

    asyncio.run(scenario())


def test_answered_writes_leave_the_deadline_queue_at_its_next_deadline(tmp_path: Path) -> None:
    """With no replica a write commits once persisted, long before its timeout: each new
    deadline drops the answered ones ahead of it, so the queue holds one write, not five."""

    async def scenario() -> None:
        with open_bucket(tmp_path, ManualClock()) as bucket:
            monitor = SyncWriteMonitor(bucket, replicas_of=lambda vb: [], replication=None)
            answers: list[object] = []
            for n in range(5):
                key = b"k%d" % n
                prepared = bucket.store_command(
                    StoreCommand(Opcode.SET, 0, 1, key, b"v"), level=int(DurabilityLevel.MAJORITY)
                )
                monitor.track_run(NEVER_TIMES_OUT, [0], [key], [prepared.seqno], [answers.append])
                for vb in bucket.vbuckets:
                    bucket.vbucket(vb).flush()
                monitor.on_persisted(sorted(bucket.vbuckets))  # alone: committed at once
            assert len(answers) == 5
            assert all(isinstance(answer, MutationResult) for answer in answers), answers
            assert monitor.pending_count == 0
            assert monitor.deadlines_queued == 1  # the last one: no deadline came after it

    asyncio.run(scenario())
