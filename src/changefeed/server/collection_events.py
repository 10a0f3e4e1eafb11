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

A vbucket that becomes active here (a promotion) may lack events: its old active wrote them
and died before they were replicated, while the manifest changed during the failover.
`SystemEventWriter.catch_up` reads which scopes and collections the vbucket's own events open
and close (its system documents, on disk and in memory) and writes what the current manifest
adds or drops beyond them, so the promoted copy's streams carry every collection the manifest
holds, before any document of it can be written there.
"""

from __future__ import annotations

import logging

from changefeed.protocol.collections import (
    SYSTEM_COLLECTION,
    SystemEvent,
    SystemEventMessage,
    decode_system_event_doc,
    encode_system_event_doc,
    system_event_key,
)
from changefeed.protocol.collections_manifest import DEFAULT_ID, Manifest
from changefeed.protocol.errors import StatusError
from changefeed.protocol.kv import StoreCommand
from changefeed.protocol.opcode import Datatype, Opcode
from changefeed.server.bucket import Bucket
from changefeed.storage import StorageError
from changefeed.storage.keys import collection_key_ranges, stored_key

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
            self._write(vb, events)

    def catch_up(self, vb: int, manifest: Manifest) -> int:
        """Write into `vb`, active here, the events that take what its own events hold to
        `manifest` (module docstring).

        Returns:
            how many events were written.
        """
        vbucket = self.bucket.vbuckets.get(vb)
        if vbucket is None or not vbucket.state.is_active:
            return 0
        try:
            held = self.held_events(vb)
        except (StorageError, ValueError) as error:  # a damaged event document, a failed read
            # The state change goes on (its caller is the map's apply); the vbucket streams
            # without the missing events until it becomes active again.
            log.error("vb %d: its system events could not be read: %s", vb, error)
            return 0
        scopes = {ident for (event, ident) in held if event is SystemEvent.CREATE_SCOPE}
        scopes -= {ident for (event, ident) in held if event is SystemEvent.DROP_SCOPE}
        begun = {
            ident: message.scope_id
            for (event, ident), message in held.items()
            if event is SystemEvent.BEGIN_COLLECTION
        }
        ended = {ident for (event, ident) in held if event is SystemEvent.END_COLLECTION}
        uid = manifest.uid
        events: list[SystemEventMessage] = []
        for sid, scope in manifest.scope_ids().items():
            if sid != DEFAULT_ID and sid not in scopes:
                events.append(
                    SystemEventMessage(
                        0, 0, 0, SystemEvent.CREATE_SCOPE, uid, sid, None, scope.name.encode()
                    )
                )
        in_manifest = manifest.by_id()
        for cid, (scope, coll) in in_manifest.items():
            if cid != DEFAULT_ID and cid not in begun:
                events.append(
                    SystemEventMessage(
                        0, 0, 0, SystemEvent.BEGIN_COLLECTION, uid, scope.uid, cid,
                        coll.name.encode(), coll.max_ttl,
                    )
                )  # fmt: skip
        for cid, sid in sorted(begun.items()):
            if cid not in in_manifest and cid not in ended:
                events.append(
                    SystemEventMessage(0, 0, 0, SystemEvent.END_COLLECTION, uid, sid, cid)
                )
        for sid in sorted(scopes):
            if sid not in manifest.scope_ids():
                events.append(SystemEventMessage(0, 0, 0, SystemEvent.DROP_SCOPE, uid, sid))
        if events:
            log.info(
                "vb %d became active without %d system events of manifest %x: written",
                vb, len(events), uid,
            )  # fmt: skip
        return self._write(vb, events)

    def held_events(self, vb: int) -> dict[tuple[SystemEvent, int], SystemEventMessage]:
        """The system events vbucket `vb` holds, by (event, collection or scope id): its
        system documents on disk (the system collection's key range) and in memory."""
        bucket = self.bucket
        vbucket = bucket.vbuckets[vb]
        docs: dict[bytes, tuple[int, bytes, bool]] = {}  # key -> (seqno, value, deleted)
        for first, end in collection_key_ranges(SYSTEM_COLLECTION):
            for seqno in bucket.store.key_range_seqnos(vb, first, end):  # one per event
                for record in list(bucket.store.scan(vb, seqno, seqno)):
                    docs[record.key] = (record.seqno, record.value, record.deleted)
        prefix = collection_key_ranges(SYSTEM_COLLECTION)[0][0]
        for checkpoint in vbucket.manager.checkpoints():  # bounded by memory's items
            for item in checkpoint.live_items():
                if item.key.startswith(prefix):
                    known = docs.get(item.key)
                    if known is None or known[0] < item.seqno:
                        docs[item.key] = (item.seqno, item.value, item.deleted)
        held: dict[tuple[SystemEvent, int], SystemEventMessage] = {}
        for seqno, value, deleted in docs.values():
            if deleted:
                continue
            message = decode_system_event_doc(value, vbucket=vb, opaque=0, seqno=seqno)
            ident = message.collection_id if message.collection_id is not None else message.scope_id
            held[message.event, ident] = message
        return held

    def _write(self, vb: int, events: list[SystemEventMessage]) -> int:
        written = 0
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
                # store cannot persist) streams without it until it becomes active again.
                log.warning("system event %s not written to vb %d: %s", event.event.name, vb, error)
                continue
            written += 1
        self.written += written
        return written
