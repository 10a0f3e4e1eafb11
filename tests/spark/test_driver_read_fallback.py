"""Which failures of the driver's own read of a batch fall back to Spark's job
(``driver_read.transport_failure``): those Spark would retry the source's task after (a node
gone or refusing, a stream refused during a failover, a connection cut mid-frame), never data
loss nor bad options, which fail the task's every attempt. Before, every failure failed the
batch at once. The fallback itself, with a real DataFrame and a refused node:
``test_dist_mirror.py``."""

from __future__ import annotations

import asyncio

import pytest

from changefeed.consumer.connection import CloseReason, ConnectionClosedError
from changefeed.protocol.errors import NoBucketError, NotMyVbucketError, ProtocolError
from changefeed.spark.cluster import SeedsUnreachableError
from changefeed.spark.driver_read import transport_failure
from changefeed.spark.options import OptionError
from changefeed.spark.reading import DataLossError, StreamFailedError


@pytest.mark.parametrize(
    "error",
    [
        StreamFailedError("vbucket 3 is not served here"),
        ConnectionRefusedError(111, "refused"),
        ConnectionClosedError(CloseReason.EOF),
        SeedsUnreachableError("127.0.0.1:1: refused"),
        TimeoutError("no answer"),
        asyncio.IncompleteReadError(b"", 24),
        ProtocolError("a frame cut short"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_transport_failure_falls_back(error: BaseException) -> None:
    assert transport_failure(error)


@pytest.mark.parametrize(
    "error",
    [
        DataLossError("vbucket 3 rolled back past the batch's start"),
        OptionError("option format must be one of json, binary, not 'x'"),
        ValueError("a bug"),
        KeyError("vbucket"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_data_loss_options_and_bugs_fail_the_batch(error: BaseException) -> None:
    assert not transport_failure(error)


def test_a_retriable_status_falls_back_and_a_final_one_does_not() -> None:
    assert NotMyVbucketError("vb 3").retriable and transport_failure(NotMyVbucketError("vb 3"))
    assert not NoBucketError("default").retriable
    assert not transport_failure(NoBucketError("default"))  # every attempt would get it
