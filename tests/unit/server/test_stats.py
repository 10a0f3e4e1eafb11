"""STAT groups read the context: vbucket counts per state, persistence health."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.context import ServerContext
from changefeed.server.stats import stat_group
from changefeed.server.users import Users
from changefeed.vbucket_state import VBucketState


@pytest.fixture
def context(tmp_path: Path) -> Iterator[ServerContext]:
    config = NodeConfig(data_dir=tmp_path, vbuckets=6, durable=False)
    bucket = Bucket.open(config, rng=random.Random(5))
    yield ServerContext(config, Users(), bucket)
    for vbucket in bucket.vbuckets.values():
        vbucket.close()
    bucket.store.close()


def test_vbucket_counts_are_per_state(context: ServerContext) -> None:
    context.bucket.vbucket(1).set_state(VBucketState.REPLICA)
    context.bucket.vbucket(2).set_state(VBucketState.REPLICA)
    context.bucket.vbucket(5).set_state(VBucketState.DEAD)
    general = dict(stat_group(context, ""))
    assert general["vb_active_num"] == "3"  # it used to count every vbucket
    assert general["vb_replica_num"] == "2"
    assert general["vb_pending_num"] == "0"
    assert general["vb_dead_num"] == "1"


def test_persistence_health_is_reported(context: ServerContext) -> None:
    assert dict(stat_group(context, ""))["persistence_failing"] == "0"
    context.bucket.persistence.failed(OSError("No space left on device"))
    general = dict(stat_group(context, ""))
    assert general["persistence_failing"] == "1"
    assert general["persistence_failures_total"] == "1"
    assert "No space left" in general["persistence_error"]
