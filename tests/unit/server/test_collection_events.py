"""System events written into vbuckets (server/collection_events.py): a vbucket that missed
manifest changes while it was not active — a replica promoted after its active died — gets,
from `catch_up`, exactly the events that take what its own events hold to the current manifest
(created scopes and collections begun, dropped ones ended), whether its events are in memory
or on disk; a second catch-up writes nothing. Checked against the vbucket that saw every change."""

from __future__ import annotations

from pathlib import Path

import pytest

from changefeed.protocol.collections import SystemEvent
from changefeed.protocol.collections_manifest import Manifest
from changefeed.server.collection_events import SystemEventWriter
from changefeed.vbucket_state import VBucketState
from support.buckets import ManualClock, open_bucket


def open_collections(writer: SystemEventWriter, vb: int) -> tuple[set[int], set[int]]:
    """(scopes, collections) the vbucket's own events leave open."""
    held = writer.held_events(vb)
    scopes = {i for e, i in held if e is SystemEvent.CREATE_SCOPE}
    scopes -= {i for e, i in held if e is SystemEvent.DROP_SCOPE}
    begun = {i for e, i in held if e is SystemEvent.BEGIN_COLLECTION}
    ended = {i for e, i in held if e is SystemEvent.END_COLLECTION}
    return scopes, begun - ended


def named(manifest: Manifest) -> tuple[set[int], set[int]]:
    return set(manifest.scope_ids()) - {0}, set(manifest.by_id()) - {0}


@pytest.mark.parametrize("flush_between", [False, True])
def test_a_promoted_vbucket_catches_up_with_the_manifest(
    tmp_path: Path, flush_between: bool
) -> None:
    with open_bucket(tmp_path, ManualClock(), vbuckets=2) as bucket:
        writer = SystemEventWriter(bucket)
        m0 = Manifest.default()
        m1 = m0.with_scope("shop").with_collection("shop", "a").with_collection("shop", "b")
        writer(m0, m1)
        assert open_collections(writer, 0) == open_collections(writer, 1) == named(m1)
        # vb 1 is a replica while the manifest changes twice (its active "died" with the
        # events): a collection created, one dropped, a scope created and dropped with its own.
        bucket.vbucket(1).set_state(VBucketState.REPLICA)
        m2 = m1.with_collection("shop", "c").without_collection("shop", "a")
        m3 = m2.with_scope("tmp").with_collection("tmp", "x")
        m4 = m3.without_scope("tmp")
        for old, new in ((m1, m2), (m2, m3), (m3, m4)):
            writer(old, new)
        assert open_collections(writer, 0) == named(m4)
        assert open_collections(writer, 1) == named(m1)  # missed them all
        if flush_between:  # the events on disk, not in memory
            for vbucket in bucket.vbuckets.values():
                while vbucket.flusher.pending:  # bounded by what is queued
                    vbucket.flusher.flush()
            assert bucket.store.high_seqno(1) == bucket.vbucket(1).high_seqno
        bucket.vbucket(1).set_state(VBucketState.ACTIVE)
        written = writer.catch_up(1, m4)
        # c begun and a ended; tmp and x never existed for vb 1, so nothing about them.
        assert written == 2
        assert open_collections(writer, 1) == named(m4)
        kinds = {(e, i) for e, i in writer.held_events(1)}
        c = m4.resolve("shop.c")[1]
        a = m1.resolve("shop.a")[1]
        assert c is not None and a is not None
        assert (SystemEvent.BEGIN_COLLECTION, c.uid) in kinds
        assert (SystemEvent.END_COLLECTION, a.uid) in kinds
        assert writer.catch_up(1, m4) == 0  # nothing more to write
        assert writer.catch_up(0, m4) == 0  # vb 0 saw every change
        bucket.vbucket(0).set_state(VBucketState.REPLICA)
        assert writer.catch_up(0, m4) == 0  # only an active vbucket is written
