"""KV commands of collections, and the one place a collections connection's keys are decoded.

A connection that negotiated HELLO Collections sends every document key as LEB128 collection id
| key (protocol/collections.py). `qualify` turns such a request into the request the handlers
already serve, with the stored key (storage/keys.py: the default collection's keys unchanged, a
named collection's marked) and the collection's maxTTL applied to the expiry, before any
handler sees it; a run of plain SETs gets the same in `qualify_set_run`. So every KV and
sub-document handler works in every collection without knowing of collections, and a connection
that did not negotiate them is not touched at all.

An id the manifest does not hold is answered UNKNOWN_COLLECTION with the manifest uid in a JSON
body (kv_engine docs/Collections.md, "Error Code 0x88"): the SDK then asks GET_COLLECTION_ID
again and retries. A dropped collection's documents stay stored until compaction purges them,
but no request reaches them (the id is never given again, collections_manifest.py).

Commands: GET_COLLECTIONS_MANIFEST (0xba), GET_COLLECTION_ID (0xbb), GET_SCOPE_ID (0xbc) for
everyone authenticated, and SET_COLLECTIONS_MANIFEST (0xb9, admin: what `changefeed collection`
sends).
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import fields, replace
from operator import itemgetter
from typing import Final

from changefeed.protocol.collections import (
    encode_id_extras,
    split_key,
    unknown_collection_body,
)
from changefeed.protocol.collections_manifest import Manifest, ManifestError
from changefeed.protocol.errors import ProtocolError, UnknownCollectionError, UnknownScopeError
from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Datatype, Opcode
from changefeed.protocol.set_run import SetRun
from changefeed.protocol.status import Status
from changefeed.server.manifest import ManifestStore
from changefeed.server.requester import Requester
from changefeed.storage.keys import stored_key

RELATIVE_EXPIRY_MAX_S: Final = 30 * 24 * 3600  # memcached: larger expiries are Unix times
NO_CREATE: Final = 0xFFFF_FFFF  # an arithmetic expiry meaning "do not create"
_U32: Final = struct.Struct(">I")
_FRAME_FIELDS: Final = ("magic", "opcode", "datatype", "vbucket", "opaque", "cas", "extras",
                         "key", "value", "framing_extras")  # fmt: skip
assert tuple(field.name for field in fields(Frame)) == _FRAME_FIELDS  # what `qualify` copies
_FIRST_BYTE: Final = itemgetter(0)
_SECOND_BYTE: Final = itemgetter(1)

# Requests whose key is a document key (everything else keeps its key as sent).
KEYED_OPCODES: Final = frozenset(
    {
        Opcode.GET,
        Opcode.SET,
        Opcode.ADD,
        Opcode.REPLACE,
        Opcode.DELETE,
        Opcode.INCREMENT,
        Opcode.DECREMENT,
        Opcode.APPEND,
        Opcode.PREPEND,
        Opcode.TOUCH,
        Opcode.GAT,
        Opcode.GET_LOCKED,
        Opcode.UNLOCK_KEY,
        Opcode.GET_META,
        Opcode.GET_REPLICA,
        Opcode.SUBDOC_MULTI_LOOKUP,
        Opcode.SUBDOC_MULTI_MUTATION,
    }
)
# Where each opcode's expiry sits in its extras (extras size -> offset), for maxTTL.
_EXPIRY_OFFSETS: Final[dict[int, dict[int, int]]] = {
    Opcode.SET: {8: 4},
    Opcode.ADD: {8: 4},
    Opcode.REPLACE: {8: 4},
    Opcode.TOUCH: {4: 0},
    Opcode.GAT: {4: 0},
    Opcode.INCREMENT: {20: 16},
    Opcode.DECREMENT: {20: 16},
    Opcode.SUBDOC_MULTI_MUTATION: {4: 0, 5: 0},
}


class UnknownCollectionAnswer(UnknownCollectionError):
    """UNKNOWN_COLLECTION whose text is the JSON body the SDK reads the manifest uid from, so
    the connection answers it like any StatusError."""

    def __init__(self, manifest_uid: int) -> None:
        super().__init__()
        self.body = unknown_collection_body(manifest_uid)

    def __str__(self) -> str:
        return self.body.decode()


class UnknownScopeAnswer(UnknownScopeError):
    """UNKNOWN_SCOPE with the manifest uid, as `UnknownCollectionAnswer`."""

    def __init__(self, manifest_uid: int) -> None:
        super().__init__()
        self.body = unknown_collection_body(manifest_uid)

    def __str__(self) -> str:
        return self.body.decode()


def capped_expiry(expiry: int, max_ttl: int, now: float) -> int:
    """The expiry a write in a collection with `max_ttl` gets (kv_engine: none or a later one
    becomes now + maxTTL), as a Unix time."""
    deadline = int(now) + max_ttl
    if expiry == 0:
        return deadline
    absolute = int(now) + expiry if expiry <= RELATIVE_EXPIRY_MAX_S else expiry
    return min(absolute, deadline)


def qualify(manifests: ManifestStore, f: Frame, now: float) -> Frame:
    """The request as the handlers serve it: the stored key of its collection, and the
    collection's maxTTL in its expiry.

    Raises:
        ProtocolError: a malformed collection id prefix.
        UnknownCollectionAnswer: a collection the manifest does not hold.
    """
    cid, key = split_key(f.key)
    if cid not in manifests.collection_ids():
        raise UnknownCollectionAnswer(manifests.uid)
    extras = f.extras
    max_ttl = manifests.max_ttl(cid) if cid else None
    if max_ttl:
        extras = _with_max_ttl(f.opcode, extras, max_ttl, now)
    # Built field by field: `replace` costs twice as much, on every request of the SDKs.
    return Frame(f.magic, f.opcode, f.datatype, f.vbucket, f.opaque, f.cas, extras,
                 stored_key(cid, key), f.value, f.framing_extras)  # fmt: skip


def _with_max_ttl(opcode: int, extras: bytes, max_ttl: int, now: float) -> bytes:
    offsets = _EXPIRY_OFFSETS.get(opcode)
    if offsets is None:
        return extras
    if opcode == Opcode.SUBDOC_MULTI_MUTATION and len(extras) in (0, 1):
        extras = bytes(4) + extras  # no expiry sent: give it one (doc flags stay last)
    offset = offsets.get(len(extras))
    if offset is None:
        return extras  # a malformed request: its handler refuses it
    (expiry,) = _U32.unpack_from(extras, offset)
    if expiry == NO_CREATE and opcode in (Opcode.INCREMENT, Opcode.DECREMENT):
        return extras
    capped = capped_expiry(expiry, max_ttl, now)
    return extras[:offset] + _U32.pack(capped) + extras[offset + 4 :]


def escape_default_key(f: Frame) -> Frame:
    """A request of a connection without collections whose key starts with 0xff: the key is
    the default collection's, stored with the marker (storage/keys.py) so that it can never
    be read as a named collection's. Other keys are stored as they are (not called for them)."""
    return replace(f, key=stored_key(0, f.key))


def qualify_set_run(run: SetRun, manifests: ManifestStore, now: float) -> bool:
    """Rewrite a run of plain SETs of a collections connection in place (stored keys, maxTTL).

    Returns:
        False, with the run untouched, if any of its keys is malformed or in an unknown
        collection: the caller serves the run one frame at a time (`set_run.run_frames`) so
        that each gets its own answer.
    """
    ids = manifests.collection_ids()
    if 0 in ids and _all_plain_default(run.keys):  # an SDK's default collection: the usual run
        run.keys = [key[1:] for key in run.keys]
        return True
    keys: list[bytes] = []
    expiries = list(run.expiries)
    for index, wire_key in enumerate(run.keys):  # bounded by the run
        try:
            cid, key = split_key(wire_key)
        except ProtocolError:
            return False
        if cid not in ids:
            return False
        keys.append(stored_key(cid, key))
        max_ttl = manifests.max_ttl(cid) if cid else None
        if max_ttl:
            expiries[index] = capped_expiry(expiries[index], max_ttl, now)
    run.keys = keys
    run.expiries = expiries
    return True


def _all_plain_default(keys: list[bytes]) -> bool:
    """Every key is the default collection's (id 0x00) and stored as sent without its id (no
    0xff first byte, storage/keys.py; the default collection has no maxTTL): checked in C
    loops, no Python call per key."""
    try:
        return not any(map(_FIRST_BYTE, keys)) and 0xFF not in map(_SECOND_BYTE, keys)
    except IndexError:  # an id and no key: the checked path refuses it
        return False


# -- handlers ----------------------------------------------------------------------------------


def get_collections_manifest(c: Requester, f: Frame) -> None:
    c.reply(f, value=c.context.manifests.current.encode(), datatype=Datatype.JSON)


def get_collection_id(c: Requester, f: Frame) -> None:
    """GET_COLLECTION_ID: the path in the value (or, from older clients, the key)."""
    path = (f.value or f.key).decode(errors="replace")
    manifest = c.context.manifests.current
    try:
        scope, collection = manifest.resolve(path)
    except ManifestError as error:
        raise ProtocolError(str(error)) from None
    if scope is None:
        raise UnknownScopeAnswer(manifest.uid)
    if collection is None:
        raise UnknownCollectionAnswer(manifest.uid)
    c.reply(f, extras=encode_id_extras(manifest.uid, collection.uid))


def get_scope_id(c: Requester, f: Frame) -> None:
    """GET_SCOPE_ID: `scope` or `scope.collection` (the collection part is ignored)."""
    path = (f.value or f.key).decode(errors="replace")
    manifest = c.context.manifests.current
    name = path.split(".", 1)[0] or "_default"
    if path.count(".") > 1:
        raise ProtocolError(f"scope path {path!r} has more than one dot")
    scope = manifest.scope(name)
    if scope is None:
        raise UnknownScopeAnswer(manifest.uid)
    c.reply(f, extras=encode_id_extras(manifest.uid, scope.uid))


def set_collections_manifest(c: Requester, f: Frame) -> None:
    """SET_COLLECTIONS_MANIFEST: the whole next manifest. A uid not above the current one is
    ERANGE (someone changed it meanwhile: read it again and redo the edit), a broken rule
    EINVAL; both name the problem. On a cluster it is answered once etcd holds it (or why
    not: cluster/manifest_store.py)."""
    manifests = c.context.manifests
    try:
        new = Manifest.decode(f.value)
    except ManifestError as error:
        raise ProtocolError(str(error)) from None
    if manifests.proposer is not None:  # a cluster: the change goes to etcd (manifest_store.py)
        c.answer_when_done(f, asyncio.ensure_future(manifests.proposer(new)), lambda _: c.reply(f))
        return
    if manifests.joining_cluster:  # applied here alone, the nodes' manifests would diverge
        c.reply(f, Status.ETMPFAIL, value=b"the node has not joined its cluster yet: retry")
        return
    if new.uid <= manifests.uid:
        c.reply(
            f,
            Status.ERANGE,
            value=f"manifest uid {new.uid:x} is not above the current {manifests.uid:x}".encode(),
        )
        return
    try:
        manifests.apply(new)
    except ManifestError as error:
        raise ProtocolError(str(error)) from None
    c.reply(f)
