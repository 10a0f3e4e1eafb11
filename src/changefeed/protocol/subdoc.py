"""Sub-document multi-path commands on the wire: SUBDOC_MULTI_LOOKUP (0xd0) and
SUBDOC_MULTI_MUTATION (0xd1), the requests and their responses (kv_engine
docs/SubDocument.md, "Multi-Path Commands"). Sans-IO: frames in, dataclasses out, and back;
what a path means is `subdoc_paths.py`'s.

Layouts (big-endian)::

    MULTI_LOOKUP request extras 0 or 1 (doc flags); key; then per path (1 to 16):
        opcode u8 | path flags u8 | path length u16 | path
    MULTI_MUTATION request extras 0, 1, 4, 5, 8 or 9:
        [expiry u32] [user flags u32 (8 and 9 only)] [doc flags u8 (1, 5 and 9)]; key; per path:
        opcode u8 | path flags u8 | path length u16 | value length u32 | path | value
    MULTI_LOOKUP response value, per path in request order:
        status u16 | value length u32 | value
    MULTI_MUTATION response value: on SUCCESS, per path that returns a value (a counter):
        index u8 | status u16 (0) | value length u32 | value;
        on SUBDOC_MULTI_PATH_FAILURE, the first failed path only: index u8 | status u16

Decoding checks what kv_engine's validators check (subdocument_validators.cc) and answers
with the same statuses: the extras' size, the doc flag combination (ADD with MKDOC, ADD with a
CAS), each path's opcode (SUBDOC_INVALID_COMBO for one of the other kind), its path flags and
the doc flags it allows (EINVAL), path lengths, values present or absent, extended-attribute
paths before body paths (SUBDOC_INVALID_XATTR_ORDER), a whole-document delete last.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import Final

from changefeed import limits
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status

LOOKUP_SPEC: Final = struct.Struct(">BBH")
MUTATION_SPEC: Final = struct.Struct(">BBHI")
LOOKUP_RESULT: Final = struct.Struct(">HI")
MUTATION_RESULT: Final = struct.Struct(">BH")
U32: Final = struct.Struct(">I")


class PathFlag(enum.IntFlag):
    NONE = 0
    MKDIR_P = 0x01  # create missing intermediate dictionaries
    XATTR_PATH = 0x04  # the path is an extended attribute's
    EXPAND_MACROS = 0x10  # ${Mutation.CAS} and friends in an xattr value
    BINARY_VALUE = 0x20  # an xattr value that is base64 binary


class DocFlag(enum.IntFlag):
    NONE = 0
    MKDOC = 0x01  # create the document if missing (upsert)
    ADD = 0x02  # create the document; fail if it exists (insert)
    ACCESS_DELETED = 0x04
    CREATE_AS_DELETED = 0x08
    REVIVE_DOCUMENT = 0x10
    REPLICA_READ = 0x20


_AD = DocFlag.ACCESS_DELETED | DocFlag.REVIVE_DOCUMENT
_CREATE = DocFlag.MKDOC | DocFlag.ADD | DocFlag.CREATE_AS_DELETED


@dataclass(frozen=True, slots=True)
class OpTraits:
    """What kv_engine's subdocument_traits.h says of one opcode inside a multi-path request."""

    mutator: bool
    whole_doc: bool
    path_flags: PathFlag
    doc_flags: DocFlag
    has_value: bool
    empty_path: bool


_X = PathFlag.XATTR_PATH
TRAITS: Final[dict[int, OpTraits]] = {
    Opcode.GET: OpTraits(False, True, PathFlag.NONE, _AD | DocFlag.REPLICA_READ, False, True),
    Opcode.SET: OpTraits(True, True, PathFlag.NONE, DocFlag.MKDOC | DocFlag.ADD, True, True),
    Opcode.DELETE: OpTraits(True, True, PathFlag.NONE, _AD, False, True),
    Opcode.SUBDOC_GET: OpTraits(
        False, False, _X | PathFlag.BINARY_VALUE, _AD | DocFlag.REPLICA_READ, False, False
    ),
    Opcode.SUBDOC_EXISTS: OpTraits(False, False, _X, _AD | DocFlag.REPLICA_READ, False, False),
    Opcode.SUBDOC_GET_COUNT: OpTraits(False, False, _X, _AD | DocFlag.REPLICA_READ, False, True),
    Opcode.SUBDOC_DICT_ADD: OpTraits(
        True,
        False,
        PathFlag.MKDIR_P | _X | PathFlag.EXPAND_MACROS | PathFlag.BINARY_VALUE,
        _AD | _CREATE,
        True,
        False,
    ),
    Opcode.SUBDOC_DICT_UPSERT: OpTraits(
        True,
        False,
        PathFlag.MKDIR_P | _X | PathFlag.EXPAND_MACROS | PathFlag.BINARY_VALUE,
        _AD | _CREATE,
        True,
        False,
    ),
    Opcode.SUBDOC_DELETE: OpTraits(True, False, _X, _AD, False, False),
    Opcode.SUBDOC_REPLACE: OpTraits(
        True,
        False,
        _X | PathFlag.EXPAND_MACROS | PathFlag.BINARY_VALUE,
        _AD | DocFlag.ADD,
        True,
        False,
    ),
    Opcode.SUBDOC_ARRAY_PUSH_LAST: OpTraits(
        True, False, PathFlag.MKDIR_P | _X | PathFlag.EXPAND_MACROS, _AD | _CREATE, True, True
    ),
    Opcode.SUBDOC_ARRAY_PUSH_FIRST: OpTraits(
        True, False, PathFlag.MKDIR_P | _X | PathFlag.EXPAND_MACROS, _AD | _CREATE, True, True
    ),
    Opcode.SUBDOC_ARRAY_INSERT: OpTraits(
        True,
        False,
        _X | PathFlag.EXPAND_MACROS,
        _AD | DocFlag.ADD | DocFlag.CREATE_AS_DELETED,
        True,
        False,
    ),
    Opcode.SUBDOC_ARRAY_ADD_UNIQUE: OpTraits(
        True, False, PathFlag.MKDIR_P | _X, _AD | _CREATE, True, True
    ),
    Opcode.SUBDOC_COUNTER: OpTraits(True, False, PathFlag.MKDIR_P | _X, _AD | _CREATE, True, False),
}
LOOKUP_EXTRAS_SIZES: Final = frozenset({0, 1})
MUTATION_EXTRAS_SIZES: Final = frozenset({0, 1, 4, 5, 8, 9})


@dataclass(frozen=True, slots=True)
class Spec:
    """One path of a multi-path request (``value`` is b"" for lookups)."""

    opcode: int
    flags: PathFlag
    path: bytes
    value: bytes = b""

    @property
    def xattr(self) -> bool:
        return bool(self.flags & PathFlag.XATTR_PATH)


@dataclass(frozen=True, slots=True)
class MultiLookup:
    key: bytes
    specs: tuple[Spec, ...]
    doc_flags: DocFlag = DocFlag.NONE


@dataclass(frozen=True, slots=True)
class MultiMutation:
    """A multi-path mutation. ``expiry`` is None when the extras carry none (the document then
    loses its expiry, unless PreserveTTL); ``user_flags`` None keeps the document's flags."""

    key: bytes
    specs: tuple[Spec, ...]
    doc_flags: DocFlag = DocFlag.NONE
    expiry: int | None = None
    user_flags: int | None = None
    cas: int = 0


@dataclass(frozen=True, slots=True)
class MutationResult:
    """One entry of a multi-mutation response."""

    index: int
    status: int
    value: bytes = b""


@dataclass(frozen=True, slots=True)
class LookupResult:
    status: int
    value: bytes = field(default=b"")


# -- requests ---------------------------------------------------------------------------------


def encode_multi_lookup(request: MultiLookup, *, vbucket: int = 0, opaque: int = 0) -> bytes:
    extras = bytes([request.doc_flags]) if request.doc_flags else b""
    body = b"".join(
        LOOKUP_SPEC.pack(s.opcode, s.flags, len(s.path)) + s.path for s in request.specs
    )
    return encode_request(
        Opcode.SUBDOC_MULTI_LOOKUP,
        vbucket=vbucket,
        opaque=opaque,
        extras=extras,
        key=request.key,
        value=body,
    )


def encode_multi_mutation(request: MultiMutation, *, vbucket: int = 0, opaque: int = 0) -> bytes:
    extras = b""
    if request.expiry is not None or request.user_flags is not None:
        extras += U32.pack(request.expiry or 0)
    if request.user_flags is not None:
        extras += U32.pack(request.user_flags)
    if request.doc_flags:
        extras += bytes([request.doc_flags])
    body = b"".join(
        MUTATION_SPEC.pack(s.opcode, s.flags, len(s.path), len(s.value)) + s.path + s.value
        for s in request.specs
    )
    return encode_request(
        Opcode.SUBDOC_MULTI_MUTATION,
        vbucket=vbucket,
        opaque=opaque,
        cas=request.cas,
        extras=extras,
        key=request.key,
        value=body,
    )


def decode_multi_lookup(frame: Frame) -> MultiLookup:
    """Raises ProtocolError with kv_engine's status for what its validators refuse."""
    key = _check_key(frame)
    if len(frame.extras) not in LOOKUP_EXTRAS_SIZES:
        raise ProtocolError(f"lookup extras of {len(frame.extras)} bytes, not 0 or 1")
    doc_flags = _doc_flags(frame.extras[0] if frame.extras else 0)
    _check_doc_flags(doc_flags, frame.cas)
    specs = _decode_specs(frame.value, mutator=False, doc_flags=doc_flags)
    return MultiLookup(key, specs, doc_flags)


def decode_multi_mutation(frame: Frame) -> MultiMutation:
    """Raises ProtocolError with kv_engine's status for what its validators refuse."""
    key = _check_key(frame)
    extras = frame.extras
    if len(extras) not in MUTATION_EXTRAS_SIZES:
        raise ProtocolError(f"mutation extras of {len(extras)} bytes, not 0, 1, 4, 5, 8 or 9")
    expiry = int(U32.unpack_from(extras)[0]) if len(extras) >= 4 else None
    user_flags = int(U32.unpack_from(extras, 4)[0]) if len(extras) >= 8 else None
    doc_flags = _doc_flags(extras[-1] if len(extras) in (1, 5, 9) else 0)
    _check_doc_flags(doc_flags, frame.cas)
    specs = _decode_specs(frame.value, mutator=True, doc_flags=doc_flags)
    return MultiMutation(key, specs, doc_flags, expiry, user_flags, frame.cas)


def _check_key(frame: Frame) -> bytes:
    if not frame.key:
        raise ProtocolError("a sub-document command needs a key")
    if len(frame.key) > limits.KEY_SIZE_MAX:
        raise ProtocolError(f"key of {len(frame.key)} bytes exceeds {limits.KEY_SIZE_MAX}")
    return frame.key


def _doc_flags(raw: int) -> DocFlag:
    if raw & ~0x3F:
        raise ProtocolError(f"unknown doc flags {raw:#04x}")
    return DocFlag(raw)


def _check_doc_flags(doc_flags: DocFlag, cas: int) -> None:
    if doc_flags & DocFlag.ADD and cas:
        raise ProtocolError("a request with the add doc flag must have CAS 0")
    if doc_flags & DocFlag.ADD and doc_flags & DocFlag.MKDOC:
        raise ProtocolError("the add and mkdoc doc flags exclude each other")
    if doc_flags & DocFlag.REVIVE_DOCUMENT and not doc_flags & DocFlag.ACCESS_DELETED:
        raise ProtocolError("revive document needs access deleted")


def _decode_specs(body: bytes, *, mutator: bool, doc_flags: DocFlag) -> tuple[Spec, ...]:
    header = MUTATION_SPEC if mutator else LOOKUP_SPEC
    specs: list[Spec] = []
    pos = 0
    body_seen = False  # a body path came: no xattr path may follow
    closed = False  # a whole-document delete came: nothing may follow
    while pos < len(body):  # bounded: each spec consumes at least its header
        if len(specs) == limits.SUBDOC_MULTI_PATHS_MAX:
            raise ProtocolError(
                f"more than {limits.SUBDOC_MULTI_PATHS_MAX} paths", Status.SUBDOC_INVALID_COMBO
            )
        if closed:
            raise ProtocolError(
                "nothing may follow a whole-document delete", Status.SUBDOC_INVALID_COMBO
            )
        if pos + header.size > len(body):
            raise ProtocolError("a path spec is truncated")
        if mutator:
            opcode, raw_flags, path_len, value_len = MUTATION_SPEC.unpack_from(body, pos)
        else:
            opcode, raw_flags, path_len = LOOKUP_SPEC.unpack_from(body, pos)
            value_len = 0
        pos += header.size
        if pos + path_len + value_len > len(body):
            raise ProtocolError("a path spec's path or value is truncated")
        path = body[pos : pos + path_len]
        value = body[pos + path_len : pos + path_len + value_len]
        pos += path_len + value_len
        spec = _check_spec(opcode, raw_flags, path, value, mutator=mutator, doc_flags=doc_flags)
        if spec.xattr and body_seen:
            raise ProtocolError("xattr paths must come first", Status.SUBDOC_INVALID_XATTR_ORDER)
        body_seen = body_seen or not spec.xattr
        closed = opcode == Opcode.DELETE
        specs.append(spec)
    if not specs:
        raise ProtocolError("a multi-path request needs a path", Status.SUBDOC_INVALID_COMBO)
    return tuple(specs)


def _check_spec(
    opcode: int, raw_flags: int, path: bytes, value: bytes, *, mutator: bool, doc_flags: DocFlag
) -> Spec:
    traits = TRAITS.get(opcode)
    if traits is None or traits.mutator != mutator:
        kind = "mutation" if mutator else "lookup"
        raise ProtocolError(
            f"opcode {opcode:#04x} is not a {kind} path operation", Status.SUBDOC_INVALID_COMBO
        )
    if raw_flags & ~int(traits.path_flags):
        raise ProtocolError(f"path flags {raw_flags:#04x} invalid for opcode {opcode:#04x}")
    flags = PathFlag(raw_flags)
    if int(doc_flags) & ~int(traits.doc_flags):
        raise ProtocolError(f"doc flags {int(doc_flags):#04x} invalid for opcode {opcode:#04x}")
    if len(path) > limits.SUBDOC_PATH_BYTES_MAX:
        raise ProtocolError(f"path of {len(path)} bytes over {limits.SUBDOC_PATH_BYTES_MAX}")
    if traits.whole_doc and path:
        raise ProtocolError(f"whole-document opcode {opcode:#04x} takes no path")
    xattr = bool(flags & PathFlag.XATTR_PATH)
    if not xattr:
        if flags & (PathFlag.EXPAND_MACROS | PathFlag.BINARY_VALUE):
            raise ProtocolError(
                "macros and binary values need an xattr path",
                Status.SUBDOC_XATTR_INVALID_FLAG_COMBO,
            )
        if not traits.empty_path and not path:
            raise ProtocolError(f"opcode {opcode:#04x} needs a path")
    else:
        if flags & PathFlag.EXPAND_MACROS and flags & PathFlag.BINARY_VALUE:
            raise ProtocolError(
                "binary values cannot expand macros", Status.SUBDOC_XATTR_INVALID_FLAG_COMBO
            )
        xattr_key = xattr_key_of(path)
        if xattr_key is None:
            raise ProtocolError("invalid xattr key", Status.XATTR_EINVAL)
        if mutator and xattr_key.startswith(b"$"):
            raise ProtocolError(
                "virtual attributes cannot be changed", Status.SUBDOC_XATTR_CANT_MODIFY_VATTR
            )
    if traits.has_value and not value:
        raise ProtocolError(f"opcode {opcode:#04x} needs a value")
    if not traits.has_value and value:
        raise ProtocolError(f"opcode {opcode:#04x} takes no value")
    return Spec(opcode, flags, path, value)


def xattr_key_of(path: bytes) -> bytes | None:
    """The extended attribute a path starts with (up to the first "." or "["), or None when
    that is not a valid key: 1 to 16 bytes of UTF-8 without control characters, and none of
    the path's metacharacters."""
    end = len(path)
    for i, byte in enumerate(path):
        if byte in b".[":
            end = i
            break
    key = path[:end]
    if not 0 < len(key) <= 16:
        return None
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if any(ord(c) < 0x20 or c in "]`," for c in text):
        return None
    return key


# -- responses --------------------------------------------------------------------------------


def encode_lookup_results(results: list[LookupResult]) -> bytes:
    return b"".join(LOOKUP_RESULT.pack(r.status, len(r.value)) + r.value for r in results)


def decode_lookup_results(value: bytes) -> list[LookupResult]:
    results: list[LookupResult] = []
    pos = 0
    while pos < len(value):  # bounded: each entry consumes at least its header
        if pos + LOOKUP_RESULT.size > len(value):
            raise ProtocolError("a lookup result is truncated")
        status, size = LOOKUP_RESULT.unpack_from(value, pos)
        pos += LOOKUP_RESULT.size
        if pos + size > len(value):
            raise ProtocolError("a lookup result's value is truncated")
        results.append(LookupResult(status, value[pos : pos + size]))
        pos += size
    return results


def encode_mutation_results(results: list[MutationResult]) -> bytes:
    """Entries with a SUCCESS status carry a value (length included); others do not."""
    out = []
    for r in results:
        out.append(MUTATION_RESULT.pack(r.index, r.status))
        if r.status == Status.SUCCESS:
            out.append(U32.pack(len(r.value)) + r.value)
    return b"".join(out)


def decode_mutation_results(value: bytes) -> list[MutationResult]:
    results: list[MutationResult] = []
    pos = 0
    while pos < len(value):  # bounded: each entry consumes at least its header
        if pos + MUTATION_RESULT.size > len(value):
            raise ProtocolError("a mutation result is truncated")
        index, status = MUTATION_RESULT.unpack_from(value, pos)
        pos += MUTATION_RESULT.size
        data = b""
        if status == Status.SUCCESS:
            if pos + U32.size > len(value):
                raise ProtocolError("a mutation result's length is truncated")
            (size,) = U32.unpack_from(value, pos)
            pos += U32.size
            if pos + size > len(value):
                raise ProtocolError("a mutation result's value is truncated")
            data = value[pos : pos + size]
            pos += size
        results.append(MutationResult(index, status, data))
    return results
