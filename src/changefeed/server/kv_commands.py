"""Handlers of the KV commands the Couchbase SDKs use beyond GET/SET/DELETE, and the helpers
the bootstrap needs (GET_ERROR_MAP, feature negotiation, the cluster map push).

Each handler has the connection's `Handler` signature and is registered in
`connection.HANDLERS`; an operating error is raised as the `StatusError` whose status is the
reply. Semantics and statuses are kv_engine's:

- GET_META answers a tombstone's metadata too (deleted = 1): the SDK's ``exists`` says False.
- TOUCH / GAT write a new version (same value, new expiry): a change with a seqno and a CAS,
  streamed over DCP like any other.
- GET_LOCKED locks the document (default 15 s, at most 30 s); while locked, reads show CAS
  0xffff...ff, and a write, TOUCH or UNLOCK must present the lock's CAS (else LOCKED); UNLOCK of
  an unlocked document is NOT_LOCKED. A connection that did not negotiate XERROR gets ETMPFAIL
  for both, as kv_engine answers old clients.
- INCREMENT / DECREMENT work on a document holding an unsigned decimal number (else
  DELTA_BADVAL); increment wraps at 2**64, decrement stops at 0; a missing document is created
  with the initial value unless the expiry is 0xffffffff (then KEY_ENOENT). The document keeps
  its flags and expiry.
- APPEND / PREPEND need the document (else NOT_STORED) and keep its flags and expiry; the
  result's JSON datatype bit says whether it is JSON.

Every mutation goes through the bucket's write path (seqno, CAS, checkpoint, DCP), refuses a
durability requirement with DURABILITY_IMPOSSIBLE (this node has no replicas to meet it), and
answers the mutation token when MutationSeqno was negotiated.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Final

from changefeed import limits
from changefeed.protocol.error_map import decode_get_error_map, error_map_json
from changefeed.protocol.errors import (
    AccessError,
    DeltaBadValueError,
    DurabilityImpossibleError,
    KeyNotFoundError,
    NotStoredError,
    NotSupportedError,
    ProtocolError,
)
from changefeed.protocol.frame import Frame
from changefeed.protocol.frame_info import (
    DurabilityRequirement,
    decode_frame_infos,
    durability_of,
)
from changefeed.protocol.kv import (
    GET_RESPONSE_EXTRAS,
    MutationResult,
    StoreCommand,
    encode_mutation_token,
)
from changefeed.protocol.kv_ops import (
    ARITHMETIC_NO_CREATE,
    U64,
    ClusterMapNotification,
    apply_arithmetic,
    decode_arithmetic,
    decode_concat,
    decode_get_locked,
    decode_get_meta,
    decode_touch,
    decode_unlock,
    encode_clustermap_notification,
    encode_get_meta_extras,
    parse_counter,
)
from changefeed.protocol.opcode import Datatype, Feature, Opcode
from changefeed.protocol.status import Status
from changefeed.server.privileges import Privilege
from changefeed.server.requester import Requester

log = logging.getLogger("changefeed.server")

FRAME_INFO_PRESERVE_TTL = 5
MAP_NOTIFICATIONS = frozenset(
    {Feature.CLUSTERMAP_CHANGE_NOTIFICATION, Feature.CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF}
)

# HELLO features that need another one requested with them (kv_engine's hello executor).
FEATURE_NEEDS = {
    Feature.CLUSTERMAP_CHANGE_NOTIFICATION: Feature.DUPLEX,
    Feature.CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF: Feature.DUPLEX,
    Feature.VATTR: Feature.XATTR,
}
# Statuses a client that did not negotiate XERROR does not know: kv_engine answers ETMPFAIL.
XERROR_ONLY_STATUSES = frozenset({Status.LOCKED, Status.NOT_LOCKED})


def negotiate(requested: tuple[int, ...], supported: frozenset[int]) -> list[int]:
    """The HELLO features granted, in the order asked: supported ones whose dependency was asked
    for too; of the two cluster map notifications, only the brief one when both are asked."""
    asked = set(requested)
    granted = []
    for feature in dict.fromkeys(requested):
        if feature not in supported:
            continue
        needed = FEATURE_NEEDS.get(feature)  # type: ignore[call-overload]
        if needed is not None and needed not in asked:
            continue
        if (
            feature == Feature.CLUSTERMAP_CHANGE_NOTIFICATION
            and Feature.CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF in asked
            and Feature.DUPLEX in asked
        ):
            continue
        granted.append(feature)
    return granted


def wire_status(c: Requester, status: int) -> int:
    """The status to answer: LOCKED and NOT_LOCKED become ETMPFAIL without XERROR."""
    if status in XERROR_ONLY_STATUSES and Feature.XERROR not in c.features:
        return Status.ETMPFAIL
    return status


def write_then_reply(
    c: Requester,
    f: Frame,
    key: bytes,
    write: Callable[[int], MutationResult],
    *,
    value: bytes = b"",
) -> None:
    """Do `write` and answer with its result (and `value`): at once for a plain write (level
    0), once the monitor commits it for one with a durability frame (`durable_write`)."""
    requirement = requirement_of(f.framing_extras)
    if requirement is None:
        reply_mutation(c, f, write(0), value=value)
    else:
        durable_write(c, f, key, requirement, write, value=value)


# The framing extras a client sends are few and repeat on every write of a pipeline (the same
# durability level and timeout): their decoded meaning is kept, a small bounded table.
_FRAMING_SEEN_MAX: Final = 64
_requirements: dict[bytes, DurabilityRequirement | None] = {}
_preserve_ttl: dict[bytes, bool] = {}


def requirement_of(framing_extras: bytes) -> DurabilityRequirement | None:
    """`durability_of`, remembered for the framing extras seen last (malformed ones raise
    each time, as `durability_of` does)."""
    if not framing_extras:
        return None
    try:
        return _requirements[framing_extras]
    except KeyError:
        pass
    requirement = durability_of(framing_extras)
    if len(_requirements) >= _FRAMING_SEEN_MAX:
        _requirements.clear()
    _requirements[framing_extras] = requirement
    return requirement


def durable_write(
    c: Requester,
    f: Frame,
    key: bytes,
    requirement: DurabilityRequirement,
    write: Callable[[int], MutationResult],
    *,
    value: bytes = b"",
) -> None:
    """A SyncWrite: refuse it up front if its level cannot be met (DURABILITY_IMPOSSIBLE),
    else `write` queues the prepare (raising as a plain write would) and the answer goes out
    when the monitor commits it — or SYNC_WRITE_AMBIGUOUS when it cannot tell in time. A
    vbucket id this node does not have is NOT_MY_VBUCKET before its chain is looked at (the
    cluster map has none for it)."""
    monitor = c.context.sync_writes
    if monitor is None:
        raise DurabilityImpossibleError("durable writes need a running node")
    c.context.bucket.vbucket(f.vbucket)  # NotMyVbucketError for an id this node has not
    monitor.check_possible(f.vbucket)
    prepared = write(int(requirement.level))
    c.answers_expected(1)
    answer = c.settled_answers.frame_answer(f, value)  # in settle order; f's header only
    monitor.track_run(requirement, [f.vbucket], [key], [prepared.seqno], [answer])


def refuse_durability(f: Frame) -> None:
    """TOUCH and GAT do not take a durability level (the SDKs send none): one that asks gets
    DURABILITY_IMPOSSIBLE, never a success pretending the level was met."""
    requirement = durability_of(f.framing_extras)
    if requirement is not None:
        raise DurabilityImpossibleError(
            f"durability {requirement.level.name.lower()} is not supported for opcode "
            f"0x{f.opcode:02x}; the write was not applied"
        )


def preserve_ttl_of(framing_extras: bytes) -> bool:
    """Whether the request carries the PreserveTTL frame info (id 5, no payload).

    Raises:
        ProtocolError: malformed frame infos, or a PreserveTTL frame info with a payload.
    """
    if not framing_extras:
        return False
    known = _preserve_ttl.get(framing_extras)
    if known is not None:
        return known
    preserve = False
    for info_id, payload in decode_frame_infos(framing_extras):
        if info_id == FRAME_INFO_PRESERVE_TTL:
            if payload:
                raise ProtocolError("the PreserveTTL frame info takes no payload")
            preserve = True
            break
    if len(_preserve_ttl) >= _FRAMING_SEEN_MAX:
        _preserve_ttl.clear()
    _preserve_ttl[framing_extras] = preserve
    return preserve


def require_privilege(c: Requester, privilege: Privilege) -> None:
    """A second privilege an opcode needs (GAT and counters read as well as write)."""
    if privilege not in c.sasl.privileges:
        name = privilege.name.lower()
        raise AccessError(f"user {c.sasl.user!r} lacks the {name} privilege")


def reply_mutation(c: Requester, f: Frame, result: MutationResult, *, value: bytes = b"") -> None:
    """CAS in the header; the mutation token as extras when MutationSeqno was negotiated."""
    extras = b""
    if Feature.MUTATION_SEQNO in c.features:
        extras = encode_mutation_token(result.vb_uuid, result.seqno)
    c.reply(f, extras=extras, value=value, cas=result.cas)


def is_json(value: bytes) -> bool:
    try:
        json.loads(value)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return True


# -- bootstrap --------------------------------------------------------------------------------


def get_error_map(c: Requester, f: Frame) -> None:
    body = error_map_json(decode_get_error_map(f))
    if body is None:
        c.reply(f, Status.KEY_ENOENT, value=b"no error map of version 0")
        return
    c.reply(f, value=body, datatype=Datatype.JSON)


def push_cluster_map(c: Requester, version: tuple[int, int], config: bytes) -> bool:
    """Send ``c`` a ClustermapChangeNotification of the map ``version`` (epoch, revision):
    the map itself, or only its version if ``c`` asked for the brief form. Nothing if ``c`` has
    not selected the bucket yet, or already fetched or was sent this version or a newer one.
    """
    if not c.bucket_selected or version <= c.map_version_seen:
        return False
    brief = Feature.CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF in c.features
    if not brief and Feature.CLUSTERMAP_CHANGE_NOTIFICATION not in c.features:
        return False
    c.map_version_seen = version
    notification = ClusterMapNotification(
        version[0], version[1], c.context.bucket.name, b"" if brief else config
    )
    c.send(encode_clustermap_notification(notification))
    log.debug("pushed cluster map %s to %s", version, c.peer)
    return True


def keep_expiry(c: Requester, command: StoreCommand) -> StoreCommand:
    """PreserveTTL: a SET or REPLACE of an existing document keeps its expiry."""
    current = c.context.bucket.read(command.vbucket, command.key)
    if current is None or command.opcode == Opcode.ADD:
        return command
    return dataclasses.replace(command, expiry=current.expiry)


# -- reads ------------------------------------------------------------------------------------


def get_meta(c: Requester, f: Frame) -> None:
    c.require_bucket()
    key, version = decode_get_meta(f)
    meta = c.context.bucket.get_meta(f.vbucket, key)
    c.reply(f, extras=encode_get_meta_extras(meta, version), cas=meta.cas)


def get_locked(c: Requester, f: Frame) -> None:
    c.require_bucket()
    key, lock_s = decode_get_locked(f)
    document = c.context.bucket.get_locked(f.vbucket, key, lock_s)
    c.reply(
        f,
        extras=GET_RESPONSE_EXTRAS.pack(document.flags),
        value=document.value,
        cas=document.cas,
        datatype=document.datatype,
    )


def unlock(c: Requester, f: Frame) -> None:
    c.require_bucket()
    key, cas = decode_unlock(f)
    c.context.bucket.unlock(f.vbucket, key, cas)
    c.reply(f)


# -- mutations --------------------------------------------------------------------------------


def touch(c: Requester, f: Frame) -> None:
    """TOUCH answers the new CAS; GAT the document too (flags, value, new CAS)."""
    c.require_bucket()
    command = decode_touch(f)
    if f.opcode == Opcode.GAT:
        require_privilege(c, Privilege.READ)
    refuse_durability(f)
    bucket = c.context.bucket
    result = bucket.touch(f.vbucket, command.key, command.expiry, cas=f.cas)
    if f.opcode == Opcode.TOUCH:
        c.reply(f, cas=result.cas)
        return
    document = bucket.read(f.vbucket, command.key)
    assert document is not None and document.cas == result.cas, (document, result)
    c.reply(
        f,
        extras=GET_RESPONSE_EXTRAS.pack(document.flags),
        value=document.value,
        cas=result.cas,
        datatype=document.datatype,
    )


def arithmetic(c: Requester, f: Frame) -> None:
    c.require_bucket()
    command = decode_arithmetic(f)
    require_privilege(c, Privilege.READ)
    bucket = c.context.bucket
    current = bucket.read(f.vbucket, command.key)
    if current is None:
        if command.expiry == ARITHMETIC_NO_CREATE or command.cas:
            raise KeyNotFoundError(f"key {command.key[:64]!r} not found")
        number = command.initial
        opcode, flags, expiry = Opcode.ADD, 0, bucket.expiry_from_wire(command.expiry)
    else:
        bucket.active(f.vbucket).check_write(command.key, command.cas)
        stored = parse_counter(current.value)
        if stored is None:
            raise DeltaBadValueError(f"key {command.key[:64]!r} does not hold a u64 number")
        number = apply_arithmetic(command.opcode, stored, command.delta)
        opcode, flags, expiry = Opcode.SET, current.flags, current.expiry
    write_then_reply(
        c, f, command.key,
        lambda level: bucket.write(
            opcode, f.vbucket, command.key, str(number).encode(), flags=flags, expiry=expiry,
            datatype=Datatype.JSON, cas=command.cas, level=level,
        ),
        value=U64.pack(number),
    )  # fmt: skip


def concat(c: Requester, f: Frame) -> None:
    """APPEND / PREPEND."""
    c.require_bucket()
    key, data = decode_concat(f)
    bucket = c.context.bucket
    current = bucket.read(f.vbucket, key)
    if current is None:
        raise NotStoredError(f"key {key[:64]!r} not found")
    bucket.active(f.vbucket).check_write(key, f.cas)
    if current.datatype & (Datatype.SNAPPY | Datatype.XATTR):
        raise NotSupportedError("appending to a compressed document or one with xattrs")
    value = current.value + data if f.opcode == Opcode.APPEND else data + current.value
    if len(value) > limits.VALUE_SIZE_MAX:
        raise ProtocolError(f"the result would be {len(value)} bytes", Status.E2BIG)
    datatype = Datatype.JSON if is_json(value) else Datatype.RAW
    write_then_reply(
        c, f, key,
        lambda level: bucket.write(
            Opcode.SET, f.vbucket, key, value, flags=current.flags, expiry=current.expiry,
            datatype=datatype, cas=f.cas, level=level,
        ),
    )  # fmt: skip
