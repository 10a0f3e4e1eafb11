"""SUBDOC_MULTI_LOOKUP and SUBDOC_MULTI_MUTATION against the bucket: the SDKs' ``lookup_in``
and ``mutate_in`` (and ``get`` with projections or ``with_expiry``, which are lookups).

A lookup reads one version of the document and answers every path (SUCCESS, or
SUBDOC_MULTI_PATH_FAILURE when a path failed; each path its own status). A mutation applies
its paths in order to a working copy; the first failing path fails the whole command
(SUBDOC_MULTI_PATH_FAILURE naming that path) and nothing is written; else the new document is
written through the bucket's write path, as any SET: a seqno, a CAS, a DCP mutation. Both run
in one event-loop step, so no other write comes between the read and the write. The lock and
CAS rules are the other writes' (LOCKED, KEY_EEXISTS), checked before the paths.

Extended attributes: the virtual ``$document`` (CAS, vbucket_uuid, seqno, revid, exptime,
flags, value_bytes, datatype, deleted, last_modified; no value_crc32c), ``$XTOC`` (always
empty) and ``$vbucket`` (HLC) can be looked up; documents here have no user xattrs, so a user
xattr path is SUBDOC_PATH_ENOENT, and writing one is NOT_SUPPORTED. So are the doc flags for
deleted documents (access deleted, create as deleted, revive). Replica reads (the ReplicaRead
document flag, HELLO SubdocReplicaRead) read this node's replica copy as GET_REPLICA does.

A mutation without an expiry in its extras leaves the document without one, as Couchbase does,
unless the request carries PreserveTTL; without user flags it keeps the document's flags.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from changefeed import limits
from changefeed.protocol.errors import (
    KeyExistsError,
    KeyNotFoundError,
    NotSupportedError,
    ProtocolError,
)
from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Datatype, Feature, Opcode
from changefeed.protocol.status import Status
from changefeed.protocol.subdoc import (
    DocFlag,
    LookupResult,
    MutationResult,
    PathFlag,
    Spec,
    decode_multi_lookup,
    decode_multi_mutation,
    encode_lookup_results,
    encode_mutation_results,
    xattr_key_of,
)
from changefeed.protocol.subdoc_paths import (
    SubdocError,
    dumps,
    lookup,
    mutate,
    parse_document,
    parse_path,
    walk,
)
from changefeed.server import kv_commands
from changefeed.server.requester import Requester
from changefeed.vbucket import Document

if TYPE_CHECKING:
    from changefeed.server.bucket import Bucket

_CREATE = DocFlag.MKDOC | DocFlag.ADD  # create the document; imply MKDIR_P on every path
UNSUPPORTED_DOC_FLAGS = DocFlag.ACCESS_DELETED | DocFlag.CREATE_AS_DELETED | DocFlag.REVIVE_DOCUMENT
ARRAY_ROOT_OPS = frozenset(
    {
        Opcode.SUBDOC_ARRAY_PUSH_LAST,
        Opcode.SUBDOC_ARRAY_PUSH_FIRST,
        Opcode.SUBDOC_ARRAY_ADD_UNIQUE,
    }
)
_DATATYPE_NAMES = ((Datatype.JSON, "json"), (Datatype.SNAPPY, "snappy"), (Datatype.XATTR, "xattr"))


def _check_request(c: Requester, doc_flags: DocFlag, specs: tuple[Spec, ...]) -> None:
    if doc_flags & UNSUPPORTED_DOC_FLAGS:
        raise NotSupportedError("deleted documents are not supported")
    if doc_flags & DocFlag.REPLICA_READ and Feature.SUBDOC_REPLICA_READ not in c.features:
        raise NotSupportedError("replica reads need the SubdocReplicaRead feature (HELLO)")
    if any(s.xattr for s in specs) and Feature.XATTR not in c.features:
        raise NotSupportedError("xattr paths need the XATTR feature (HELLO)")


# -- lookups ----------------------------------------------------------------------------------


def multi_lookup(c: Requester, f: Frame) -> None:
    c.require_bucket()
    request = decode_multi_lookup(f)
    _check_request(c, request.doc_flags, request.specs)
    bucket = c.context.bucket
    if request.doc_flags & DocFlag.REPLICA_READ:  # lookup_in_any/all_replicas: this copy
        document: Document | None = bucket.get_replica(f.vbucket, request.key)
    else:
        document = bucket.read(f.vbucket, request.key)
    if document is None:
        raise KeyNotFoundError(f"key {request.key[:64]!r} not found")
    vb_uuid = bucket.vbucket(f.vbucket).vb_uuid
    body = _Body(document.value)
    results = []
    for spec in request.specs:
        try:
            value = _lookup_one(spec, document, body, vb_uuid, bucket)
            results.append(LookupResult(Status.SUCCESS, value))
        except SubdocError as error:
            results.append(LookupResult(error.status))
    failed = any(r.status != Status.SUCCESS for r in results)
    status = Status.SUBDOC_MULTI_PATH_FAILURE if failed else Status.SUCCESS
    c.reply(f, status, value=encode_lookup_results(results), cas=document.cas)


class _Body:
    """The document body, parsed on first use (a lookup of only xattrs never parses it)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self._root: Any = None
        self._error: SubdocError | None = None
        self._parsed = False

    def root(self) -> Any:
        if not self._parsed:
            self._parsed = True
            try:
                self._root = parse_document(self.raw)
            except SubdocError as error:
                self._error = error
        if self._error is not None:
            raise self._error
        return self._root


def _lookup_one(spec: Spec, document: Document, body: _Body, vb_uuid: int, bucket: Bucket) -> bytes:
    if spec.opcode == Opcode.GET:  # the whole body, whatever it is
        return document.value
    if spec.xattr:
        return _lookup_xattr(spec, document, vb_uuid, bucket)
    return lookup(body.root(), spec.opcode, spec.path)


def _lookup_xattr(spec: Spec, document: Document, vb_uuid: int, bucket: Bucket) -> bytes:
    key = xattr_key_of(spec.path)
    assert key is not None, spec  # the decoder checked it
    if key == b"$document":
        attribute: Any = {"$document": document_vattr(document, vb_uuid)}
    elif key == b"$XTOC":
        attribute = {"$XTOC": []}
    elif key == b"$vbucket":
        attribute = {"$vbucket": {"HLC": {"now": str(int(bucket.now())), "mode": "real"}}}
    elif key.startswith(b"$"):
        raise SubdocError(Status.SUBDOC_XATTR_UNKNOWN_VATTR, f"no virtual attribute {key!r}")
    else:
        raise SubdocError(Status.SUBDOC_PATH_ENOENT, "documents here have no user xattrs")
    # The path addresses the attribute like a document whose one key is the attribute's name.
    node = walk(attribute, parse_path(spec.path))
    if spec.opcode == Opcode.SUBDOC_GET:
        return dumps(node)
    if spec.opcode == Opcode.SUBDOC_EXISTS:
        return b""
    if not isinstance(node, dict | list):
        raise SubdocError(Status.SUBDOC_PATH_MISMATCH, "count of a scalar")
    return str(len(node)).encode()


def document_vattr(document: Document, vb_uuid: int) -> dict[str, Any]:
    """kv_engine's ``$document`` virtual attribute of a live document."""
    names = [name for bit, name in _DATATYPE_NAMES if document.datatype & bit] or ["raw"]
    return {
        "CAS": f"0x{document.cas:016x}",
        "vbucket_uuid": f"0x{vb_uuid:016x}",
        "seqno": f"0x{document.seqno:016x}",
        "revid": str(document.rev_seqno),
        "exptime": document.expiry,
        "flags": document.flags,
        "value_bytes": len(document.value),
        "datatype": names,
        "deleted": False,
        "last_modified": str(document.cas // 1_000_000_000),
    }


# -- mutations --------------------------------------------------------------------------------


def multi_mutation(c: Requester, f: Frame) -> None:
    c.require_bucket()
    request = decode_multi_mutation(f)
    _check_request(c, request.doc_flags, request.specs)
    if any(s.xattr for s in request.specs):
        raise NotSupportedError("user extended attributes are not supported")
    preserve_ttl = kv_commands.preserve_ttl_of(f.framing_extras)
    bucket = c.context.bucket
    current = bucket.read(f.vbucket, request.key)
    creating = current is None
    if creating:
        if request.cas or not request.doc_flags & (DocFlag.MKDOC | DocFlag.ADD):
            raise KeyNotFoundError(f"key {request.key[:64]!r} not found")
    else:
        if request.doc_flags & DocFlag.ADD:
            raise KeyExistsError(f"key {request.key[:64]!r} exists")
        bucket.active(f.vbucket).check_write(request.key, request.cas)
    # Apply every path to a working copy; the first failure fails the command.
    body: bytes | None = None if creating else current.value  # type: ignore[union-attr]
    root: Any = None
    parsed = False
    delete = False
    results: list[MutationResult] = []
    for index, spec in enumerate(request.specs):
        try:
            if spec.opcode == Opcode.SET:
                body, root, parsed = spec.value, None, False
                continue
            if spec.opcode == Opcode.DELETE:
                delete = True
                continue
            if not parsed:
                root = _initial_root(request.specs) if body is None else parse_document(body)
                parsed = True
            mkdir = bool(spec.flags & PathFlag.MKDIR_P or request.doc_flags & _CREATE)
            answer = mutate(root, spec.opcode, spec.path, spec.value, mkdir=mkdir)
            if answer is not None:
                results.append(MutationResult(index, Status.SUCCESS, answer))
        except SubdocError as error:
            failure = encode_mutation_results([MutationResult(index, error.status)])
            c.reply(f, Status.SUBDOC_MULTI_PATH_FAILURE, value=failure)
            return
    if delete:
        if creating:
            raise KeyNotFoundError(f"key {request.key[:64]!r} not found")
        kv_commands.write_then_reply(
            c, f, request.key,
            lambda level: bucket.delete(f.vbucket, request.key, cas=request.cas, level=level),
        )  # fmt: skip
        return
    if parsed:
        body = dumps(root)
    assert body is not None
    if len(body) > limits.VALUE_SIZE_MAX:
        raise ProtocolError(f"the document would be {len(body)} bytes", Status.E2BIG)
    datatype = Datatype.JSON if parsed or kv_commands.is_json(body) else Datatype.RAW
    if current is not None and preserve_ttl:
        expiry = current.expiry
    else:
        expiry = bucket.expiry_from_wire(request.expiry or 0)
    if request.user_flags is not None:
        flags = request.user_flags
    else:
        flags = current.flags if current is not None else 0
    opcode = Opcode.ADD if creating else Opcode.SET
    kv_commands.write_then_reply(
        c, f, request.key,
        lambda level: bucket.write(
            opcode, f.vbucket, request.key, body, flags=flags, expiry=expiry,
            datatype=datatype, cas=request.cas, level=level,
        ),
        value=encode_mutation_results(results),
    )  # fmt: skip


def _initial_root(specs: tuple[Spec, ...]) -> Any:
    """The root of a document the mutation creates: an array when the first body path is an
    array operation on the root itself, else an object (kv_engine's rule)."""
    first = next(s for s in specs if s.opcode not in (Opcode.SET, Opcode.DELETE))
    if first.opcode in ARRAY_ROOT_OPS and not first.path:
        return []
    return {}
