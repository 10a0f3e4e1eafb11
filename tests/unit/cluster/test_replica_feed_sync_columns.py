"""The replica feed given DCP_PREPAREs / DCP_COMMITs as columns (``decode_batch``'s default)
leaves its vbuckets as the feed given them as frames (``sync_columns=False``, each decoded by
the message decoders) leaves them: hypothesis scripts of durable writes (documents and
deletes, random fields), plain mutations, noops and markers over two vbuckets, cut into
received buffers anywhere between frames, with bad frames (a prepare its decoder refuses, a
commit of a prepare the replica does not hold) and checkpoint memory refused part of the way.
Compared: the feed's failure (type and text), items taken, the bytes the feed sent, every
vbucket's high seqno, pending prepares (all fields) and documents (all metadata) on disk."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from changefeed.cluster.replica_stream import FeedOptions, ReplicaFeed
from changefeed.protocol.batch import decode_batch
from changefeed.protocol.dcp import encode_failover_log
from changefeed.protocol.dcp_items import (
    Abort,
    Commit,
    Mutation,
    Prepare,
    encode_abort,
    encode_commit,
    encode_mutation,
    encode_prepare,
)
from changefeed.protocol.errors import ProtocolError, StatusError
from changefeed.protocol.frame import encode_frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.snapshot_marker import MarkerFlag, SnapshotMarker, encode_snapshot_marker
from changefeed.server.bucket import Bucket
from changefeed.vbmap import NodeAddress
from support.replica_feed import refuse_memory_once, replica_bucket, state

SNAPSHOT_END = 1000
KEYS = 4


class RecordingLink:
    """The feed's connection, reduced to what it sends (the transport, not our component)."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self._opaque = 0

    def next_opaque(self) -> int:
        self._opaque += 1
        return self._opaque

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def pause_reading(self) -> None:
        self.sent.append(b"pause")

    def resume_reading(self) -> None:
        self.sent.append(b"resume")


def frames_of(script: list[tuple[int, int, str, int]]) -> list[bytes]:
    """An active's stream for `script` (vb, key, what, a number for the fields): a marker per
    vbucket first, seqnos rising per vbucket."""
    frames = [
        encode_snapshot_marker(SnapshotMarker(vb, 1, 1, SNAPSHOT_END, MarkerFlag.MEMORY))
        for vb in range(2)
    ]
    seqnos = [0, 0]
    pending: dict[tuple[int, bytes], int] = {}
    for vb, key_number, what, n in script:
        key = b"k%d" % key_number
        if what == "noop":
            frames.append(encode_frame(Magic.REQUEST, Opcode.DCP_NOOP, opaque=n))
            continue
        seqnos[vb] += 1
        seqno = seqnos[vb]
        prepared = pending.pop((vb, key), None)
        if what == "bad prepare":  # level 0: decode_prepare refuses it
            extras = bytearray(31)
            extras[7] = seqno & 0xFF
            frame = encode_frame(
                Magic.REQUEST, Opcode.DCP_PREPARE, vbucket=vb, cas=9, extras=bytes(extras),
                key=key,
            )  # fmt: skip
            frames.append(frame)
        elif what == "stray commit":  # a prepare the replica does not hold
            frames.append(encode_commit(Commit(vb, 1, key, max(1, seqno - 1) + 500, seqno + 600)))
        elif what == "mutation":
            frames.append(
                encode_mutation(Mutation(vb, 1, seqno, key, b"m%d" % n, 50 + n, n, n, 2 * n))
            )
        elif prepared is None or what in ("prepare", "prepare deleted"):
            deleted = what == "prepare deleted" or (what == "abort" and n % 2 == 0)
            prepare = Prepare(
                vb, 1, seqno, key, b"" if deleted else b"v%d-%d" % (vb, seqno), 100 + seqno,
                n + 1, n, 3 * n, deleted, 1 + n % 3, n % 4, 7 * n,
            )  # fmt: skip
            frames.append(encode_prepare(prepare))
            pending[(vb, key)] = seqno
        elif what == "commit":
            frames.append(encode_commit(Commit(vb, 1, key, prepared, seqno)))
        else:
            frames.append(encode_abort(Abort(vb, 1, key, prepared, seqno)))
    return frames


def run_feed(
    bucket: Bucket, buffers: list[bytes], sync_columns: bool, full_at: int
) -> tuple[object, ...]:
    """Feed `buffers` to a replica feed of `bucket`, a tick after each (as the session loop
    ticks), vbucket 0 refusing memory at its `full_at`-th sync item (0: never); stop at the
    first failure, whether a push set it or a tick raised it."""
    feed = ReplicaFeed(
        bucket, NodeAddress("active", "127.0.0.1", 1), {0, 1}, FeedOptions(node_name="me")
    )
    link = RecordingLink()
    feed.attach(link)
    feed.request_all()  # opaques 1 and 2; answered first, so acks flow (DCP_SEQNO_ACKNOWLEDGED)
    answers = [
        encode_frame(
            Magic.RESPONSE,
            Opcode.DCP_STREAM_REQ,
            opaque=vb + 1,
            value=encode_failover_log([(0xABC + vb, 0)]),
        )
        for vb in range(2)
    ]
    feed.on_push(decode_batch(b"".join(answers)))
    tick_failure: BaseException | None = None
    if full_at:
        refuse_memory_once(bucket.vbucket(0), full_at)
    for buffer in buffers:
        batch = decode_batch(buffer, sync_columns=sync_columns)
        assert batch.consumed == len(buffer)
        if not sync_columns:
            assert not len(batch.syncs)
        feed.on_push(batch)
        if feed.failure is not None:
            break
        try:  # what waited for memory goes in: a bad commit held back raises here
            feed.tick()
        except (StatusError, ProtocolError) as error:  # ReplicaFeed.run reconnects on these
            tick_failure = error
            break
    failure = feed.failure or tick_failure
    described = None if failure is None else (type(failure).__name__, str(failure))
    return described, feed.stats.items, link.sent, state(bucket, KEYS)


def _spread(bursts: list[tuple[int, int, str, int, int]]) -> list[tuple[int, int, str, int]]:
    """A burst is one step over `width` consecutive keys of one vbucket: back to back on the
    wire, so prepares and commits come in runs (one key at a time, a run was rare)."""
    return [
        (vb, (key + i) % KEYS, what, n + i)
        for vb, key, what, n, width in bursts
        for i in range(width)
    ]


script_of = st.lists(
    st.tuples(
        st.integers(0, 1),
        st.integers(0, KEYS - 1),
        st.sampled_from(
            [
                "prepare",
                "prepare",
                "prepare deleted",
                "commit",
                "commit",
                "commit",
                "abort",
                "mutation",
                "noop",
                "bad prepare",
                "stray commit",
            ]
        ),
        st.integers(0, 1000),
        st.integers(1, KEYS),
    ),
    min_size=1,
    max_size=16,
).map(_spread)


@settings(
    max_examples=40,
    derandomize=True,  # CI runs the same examples each time (a failure here is a bug to keep)
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(script_of, st.lists(st.integers(1, 12), max_size=6), st.integers(0, 12))
# A noop between two prepares ends a run of columns, not of frames: memory refused at the
# first prepare must hit it on both paths (it hit a different item when runs were counted).
@example(script=[(0, 0, "prepare", 0), (0, 0, "noop", 0), (0, 1, "prepare", 0)], cuts=[], full_at=1)
# Commits in a run wait behind prepares held back for memory, on both paths.
@example(
    script=[(0, 0, "prepare", 0), (0, 1, "prepare", 1), (0, 0, "commit", 0), (0, 1, "commit", 1)],
    cuts=[],
    full_at=1,
)
# A commit and a stray one across a noop: one run of frames, two of columns; both count the
# commit the vbucket took before refusing the stray one (the run of frames counted none).
@example(
    script=[
        (0, 0, "prepare", 0),
        (0, 0, "commit", 0),
        (0, 0, "noop", 0),
        (0, 0, "stray commit", 0),
    ],
    cuts=[],
    full_at=0,
)
# A stray commit held back for memory fails in the tick that retries it, on both paths.
@example(
    script=[(0, 0, "prepare", 0), (0, 1, "prepare", 0), (0, 0, "stray commit", 0)],
    cuts=[],
    full_at=1,
)
def test_columns_leave_what_frames_leave(
    tmp_path_factory: pytest.TempPathFactory,
    script: list[tuple[int, int, str, int]],
    cuts: list[int],
    full_at: int,
) -> None:
    frames = frames_of(script)
    buffers: list[bytes] = []
    position = 0
    for count in [*cuts, len(frames)]:  # received buffers cut between frames
        if position < len(frames):
            buffers.append(b"".join(frames[position : position + count]))
            position += count
    if position < len(frames):
        buffers.append(b"".join(frames[position:]))
    root = tmp_path_factory.mktemp("feed")
    (root / "columns").mkdir()
    (root / "frames").mkdir()
    with (
        replica_bucket(root / "columns") as columns_bucket,
        replica_bucket(root / "frames") as frames_bucket,
    ):
        columns = run_feed(columns_bucket, buffers, True, full_at)
        frames_way = run_feed(frames_bucket, buffers, False, full_at)
        assert columns == frames_way
