"""An in-process bucket on a temporary directory, with a clock the test moves by hand."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig


class ManualClock:
    """Wall-clock seconds that only move when the test says so (`clock.now += 5`)."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def open_bucket(
    path: Path,
    clock: ManualClock,
    *,
    vbuckets: int = 4,
    seed: int = 7,
    checkpoint_quota_bytes: int | None = None,
) -> Iterator[Bucket]:
    """A real bucket (non-durable LMDB) on `path`; every vbucket flushed and closed after.
    `checkpoint_quota_bytes`: the checkpoint memory quota, if not the default."""
    config = NodeConfig(data_dir=path, vbuckets=vbuckets, durable=False)
    if checkpoint_quota_bytes is not None:
        config = dataclasses.replace(config, checkpoint_quota_bytes=checkpoint_quota_bytes)
    opened = Bucket.open(config, clock=clock, rng=random.Random(seed))
    try:
        yield opened
    finally:
        for vbucket in opened.vbuckets.values():
            vbucket.close()
        opened.store.close()
