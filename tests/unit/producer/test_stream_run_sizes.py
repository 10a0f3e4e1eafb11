"""How many events a stream takes from its reader per call (`limits.STREAM_RUN_EVENTS_MAX`, a
knob to tune: memory runs are framed twice-touched, disk runs are copies) changes no byte a
stream sends: every pump call's bytes, from disk then from memory, equal those of a stream
reading one event at a time, for budgets that cut runs anywhere (so no run overshoots its
budget by more than one event does); flow control counts what was written."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from changefeed import limits
from changefeed.producer.producer import DcpProducer
from changefeed.producer.stream_request import Accepted
from changefeed.protocol.dcp import OpenFlag, StreamRequest
from changefeed.protocol.frame import HEADER
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig

VBS = (0, 1, 2)
FLAGS = OpenFlag.PRODUCER | OpenFlag.INCLUDE_DELETE_TIMES


class FakeClock:
    def __call__(self) -> float:
        return 1000.0


def open_bucket(path: Path) -> Bucket:
    return Bucket.open(
        NodeConfig(data_dir=path, vbuckets=4, durable=False),
        clock=FakeClock(),
        rng=random.Random(3),
    )


def close_bucket(bucket: Bucket) -> None:
    for vbucket in bucket.vbuckets.values():
        vbucket.close()  # flushes what is queued
    bucket.store.close()


def write(bucket: Bucket) -> None:
    """Enough records per vbucket for runs of hundreds; overwrites and deletions leave gaps."""
    for vb in VBS:
        vbucket = bucket.vbucket(vb)
        for n in range(700):
            vbucket.set(b"k%d-%d" % (vb, n % 500), b"v" * (n * 13 % 90), flags=n)
            if n % 7 == 3:
                vbucket.delete(b"k%d-%d" % (vb, n % 500))


def streamed(bucket: Bucket, budgets: Iterator[int]) -> tuple[list[bytes], int, int]:
    """Every vb of VBS from 0 to its high seqno: (every pump call's bytes in order, bytes
    written, bytes flow control counted). Compared call by call, not split by vbucket: a call
    that frames past its budget moves bytes from one call to the next, which a per-vbucket
    comparison of the whole stream cannot see."""
    p = DcpProducer("test", FLAGS, source=bucket, clock=FakeClock())
    assert p.control("connection_buffer_size", str(2**31))[0] == 0
    for vb in VBS:
        high = bucket.vbucket(vb).high_seqno
        assert isinstance(p.stream_request(StreamRequest(vb, vb, 0, 0, high, 0, 0, 0)), Accepted)
    out: list[bytes] = []
    calls: list[bytes] = []
    for budget in budgets:  # bounded by the caller's budgets
        if not p.ready:
            break
        mark = len(out)
        p.pump(out, budget)
        calls.append(b"".join(out[mark:]))
    assert not p.ready, "budgets ran out before the streams were drained"
    written = sum(map(len, calls))
    vbs = set()
    data = b"".join(calls)
    at = 0
    while at < len(data):  # bounded: each frame moves on; the frames parse whole
        vbs.add(HEADER.unpack_from(data, at)[7])  # by opaque (= vb)
        at += HEADER.size + HEADER.unpack_from(data, at)[6]
    assert at == len(data) and vbs == set(VBS), (at, len(data), vbs)
    return calls, written, p.flow.outstanding_bytes


def cycle(budgets: list[int]) -> Iterator[int]:
    for _ in range(1_000_000):  # bounded: enough rounds for any drained test stream
        yield from budgets


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bucket")
    bucket = open_bucket(path)
    write(bucket)
    close_bucket(bucket)
    return path


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    budgets=st.lists(st.integers(1, 70_000), min_size=1, max_size=6),
    run_max=st.sampled_from([2, 64, 1024]),
)
# Budgets of every size a frame or two takes: some end exactly where a run's frames before its
# last end, where a run must stop (one framing the last too overshoots: the review's mutant S3).
@example(budgets=list(range(40, 200)), run_max=2)
def test_run_sizes_change_no_byte_sent(data_dir: Path, budgets: list[int], run_max: int) -> None:
    bucket = open_bucket(data_dir)  # memory is empty: every stream starts with a backfill
    try:
        for vb in VBS:  # and then memory: changes after the stored ones
            for n in range(40):
                bucket.vbucket(vb).set(b"late%d-%d" % (vb, n % 30), b"w" * n)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(limits, "STREAM_RUN_EVENTS_MAX", run_max)
            got, written, counted = streamed(bucket, cycle(budgets))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(limits, "STREAM_RUN_EVENTS_MAX", 1)
            expected, _, _ = streamed(bucket, cycle(budgets))
    finally:
        close_bucket(bucket)
    assert got == expected
    assert counted == written
