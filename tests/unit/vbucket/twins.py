"""Twin vbuckets: one written the way under test, the other one write at a time, compared."""

from __future__ import annotations

from collections.abc import Callable

from changefeed.storage import Store
from changefeed.vbucket import VBucket


def assert_flushed_alike(
    run_vb: VBucket,
    run_store: Store,
    one_vb: VBucket,
    one_store: Store,
    stored: Callable[[Store], object],
) -> None:
    """Flushes both twins; their stores then hold the same (as `stored` reads a store)."""
    run_vb.flush()
    one_vb.flush()
    assert stored(run_store) == stored(one_store)
