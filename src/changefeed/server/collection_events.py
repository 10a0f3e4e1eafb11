"""System events: each manifest change becomes one change per event in every active vbucket.

kv_engine writes a system event into every vbucket when a collection or scope is created or
dropped, so a DCP stream sees it in seqno order with the documents around it. Here an event is
a document of the reserved system collection (protocol/collections.py `SYSTEM_COLLECTION`),
written through the bucket's ordinary write path: it gets a seqno, sits in the checkpoint, is
persisted, backfilled and replicated like any change, with no new path through the vbucket.
The producer turns it into DCP_SYSTEM_EVENT for streams that negotiated collections and
skips it for the others (producer/collection_stream.py).

Order inside one manifest change: scopes created, collections created, collections dropped,
scopes dropped (a dropped scope's collections end before it).
"""

from __future__ import annotations

import logging

from changefeed.protocol.collections import (
    SYSTEM_COLLECTION,
    SystemEvent,
    SystemEventMessage,
    encode_system_event_doc,
    system_event_key,
)
from changefeed.protocol.collections_manifest import Manifest
from changefeed.protocol.errors import StatusError
from changefeed.protocol.kv import StoreCommand
from changefeed.protocol.opcode import Datatype, Opcode
from changefeed.server.bucket import Bucket
from changefeed.storage.keys import stored_key

log = logging.getLogger("changefeed.server")


def events_between(old: Manifest, new: Manifest) -> list[SystemEventMessage]:
    """The system events that take `old` to `new` (vbucket, opaque and seqno left 0)."""
    uid = new.uid
    events: list[SystemEventMessage] = []
    old_scopes, new_scopes = old.scope_ids(), new.scope_ids()
    old_ids, new_ids = old.by_id(), new.by_id()
    for sid, scope in new_scopes.items():
        if sid not in old_scopes:
            events.append(
                SystemEventMessage(
                    0, 0, 0, SystemEvent.CREATE_SCOPE, uid, sid, None, scope.name.encode()
                )
            )
    for cid, (scope, coll) in new_ids.items():
        if cid not in old_ids:
            events.append(
                SystemEventMessage(
                    0, 0, 0, SystemEvent.BEGIN_COLLECTION, uid, scope.uid, cid,
                    coll.name.encode(), coll.max_ttl,
                )
            )  # fmt: skip
    for cid, (scope, _) in old_ids.items():
        if cid not in new_ids:
            events.append(
                SystemEventMessage(0, 0, 0, SystemEvent.END_COLLECTION, uid, scope.uid, cid)
            )
    for sid in old_scopes:
        if sid not in new_scopes:
            events.append(SystemEventMessage(0, 0, 0, SystemEvent.DROP_SCOPE, uid, sid))
    return events


class SystemEventWriter:
    """A manifest listener (server/manifest.py) that writes each change's events into every
    vbucket active on this node."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.written = 0  # event documents written (STAT, tests)

    def __call__(self, old: Manifest, new: Manifest) -> None:
        events = events_between(old, new)
        if not events:
            return
        for vb in sorted(self.bucket.vbuckets):  # bounded by the bucket's vbuckets
            vbucket = self.bucket.vbuckets[vb]
            if not vbucket.state.is_active:
                continue  # a replica gets the events from its active's stream
            for event in events:
                ident = event.collection_id if event.collection_id is not None else event.scope_id
                key = stored_key(SYSTEM_COLLECTION, system_event_key(event.event, ident))
                command = StoreCommand(
                    Opcode.SET, vb, 0, key, encode_system_event_doc(event), datatype=Datatype.JSON
                )
                try:
                    self.bucket.store_command(command)
                except StatusError as error:
                    # The manifest is durable; a vbucket that cannot take the event now (its
                    # store cannot persist) streams without it.
                    log.warning(
                        "system event %s not written to vb %d: %s", event.event.name, vb, error
                    )
                    continue
                self.written += 1
