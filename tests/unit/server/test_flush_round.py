"""One flush round writes every vbucket with queued items in one transaction (one commit, one
fsync), and a commit that fails leaves every vbucket's items queued for the next round."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.server.bucket import Bucket
from changefeed.storage import StorageError, WriteBatch
from support.buckets import ManualClock, open_bucket


@pytest.fixture
def bucket(tmp_path: Path) -> Iterator[Bucket]:
    with open_bucket(tmp_path, ManualClock(), vbuckets=4, seed=3) as opened:
        yield opened


def count_commits(bucket: Bucket, fail_first: bool = False) -> list[int]:
    commits = [0]
    original = bucket.store.write_batch
    failing = [fail_first]

    @contextlib.contextmanager
    def counted() -> Iterator[WriteBatch]:
        with original() as batch:
            yield batch
            if failing[0]:
                failing[0] = False
                raise StorageError("injected commit failure")
        commits[0] += 1

    bucket.store.write_batch = counted  # type: ignore[method-assign]
    return commits


def test_a_round_is_one_commit_for_every_vbucket(bucket: Bucket) -> None:
    for vb in range(4):
        for n in range(5):
            bucket.vbucket(vb).set(b"k%d-%d" % (vb, n), b"v")
    commits = count_commits(bucket)
    assert bucket._flush_round() == 20
    assert commits == [1]
    assert all(bucket.vbucket(vb).persisted_seqno == 5 for vb in range(4))
    assert bucket._flush_round() == 0 and commits == [1]  # an empty round commits nothing


def test_a_failed_round_loses_nothing(bucket: Bucket) -> None:
    for vb in range(4):
        bucket.vbucket(vb).set(b"k%d" % vb, b"v")
    count_commits(bucket, fail_first=True)
    with pytest.raises(StorageError):
        bucket._flush_round()
    assert all(bucket.vbucket(vb).persisted_seqno == 0 for vb in range(4))
    assert bucket._flush_round() == 4
    assert all(bucket.vbucket(vb).persisted_seqno == 1 for vb in range(4))
    assert all(bucket.store.get(vb, b"k%d" % vb) is not None for vb in range(4))
