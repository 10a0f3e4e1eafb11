"""GET_ERROR_MAP (0xfe): what each status this node answers means, in kv_engine's JSON format.

A client that negotiated XERROR asks for the map right after authenticating and decides from a
status's attributes what to do with it (retry now, retry later, refresh the cluster map, give
up...) — also for statuses it does not know. The Couchbase SDKs abort the connection when the
request is refused, so a node that grants XERROR must answer it.

Request: no extras, no key, value = the highest map version the client understands (u16),
header vbucket 0. Response value (JSON)::

    {"version": 2, "revision": N,
     "errors": {"<status in lowercase hex>": {"name": ..., "desc": ..., "attrs": [...]}, ...}}

Version 1 is version 2 without the attributes added later ("rate-limit", "no-retry",
"system-constraint"), with revision 4 + N, exactly as kv_engine derives it
(daemon/error_map_manager.cc); asking for version 0 is answered KEY_ENOENT (there is no such
map), and for a version above 2 with version 2. Names, descriptions and attributes are
kv_engine's (etc/couchbase/kv/error_maps/error_map_v2.json) for every status in `Status`, so an
SDK treats this node's answers exactly as Couchbase Server's.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Final

from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status

VERSION_MAX: Final = 2
REVISION: Final = 1  # of our version-2 map; bump when an entry changes
_VERSION = struct.Struct(">H")

# Attributes a version-1 map may carry (kv_engine's v2to1).
V1_ATTRIBUTES: Final = frozenset(
    {
        "item-deleted",
        "item-locked",
        "item-only",
        "invalid-input",
        "fetch-config",
        "conn-state-invalidated",
        "auth",
        "special-handling",
        "support",
        "temp",
        "internal",
        "retry-now",
        "retry-later",
        "subdoc",
        "dcp",
        "success",
    }
)
# Every attribute a version-2 map may carry (what the Couchbase SDKs recognise).
V2_ATTRIBUTES: Final = V1_ATTRIBUTES | {"auto-retry", "rate-limit", "no-retry", "system-constraint"}


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """One status as the map describes it."""

    code: int
    name: str
    desc: str
    attrs: tuple[str, ...]


def _info(status: Status, name: str, desc: str, *attrs: str) -> ErrorInfo:
    return ErrorInfo(int(status), name, desc, attrs)


# kv_engine's entries (name, description, attributes) for each status of `Status`.
ERRORS: Final[tuple[ErrorInfo, ...]] = (
    _info(Status.SUCCESS, "SUCCESS", "Success", "success"),
    _info(Status.KEY_ENOENT, "KEY_ENOENT", "Not Found", "item-only"),
    _info(Status.KEY_EEXISTS, "KEY_EEXISTS", "key already exists, or CAS mismatch", "item-only"),
    _info(Status.E2BIG, "E2BIG", "Value is too big", "item-only", "invalid-input"),
    _info(Status.EINVAL, "EINVAL", "Invalid packet", "internal", "invalid-input"),
    _info(Status.NOT_STORED, "NOT_STORED", "Not Stored", "internal", "item-only"),
    _info(
        Status.DELTA_BADVAL,
        "DELTA_BADVAL",
        "Existing document not a number",
        "item-only",
        "invalid-input",
    ),
    _info(
        Status.NOT_MY_VBUCKET,
        "NOT_MY_VBUCKET",
        "Server does not know about this vBucket",
        "fetch-config",
        "invalid-input",
    ),
    _info(Status.NO_BUCKET, "NO_BUCKET", "Not connected to any bucket", "conn-state-invalidated"),
    _info(
        Status.LOCKED,
        "LOCKED",
        "Requested resource is locked",
        "item-locked",
        "item-only",
        "retry-now",
    ),
    _info(
        Status.DCP_STREAM_NOT_FOUND,
        "STREAM_NOT_FOUND",
        "Stream not found",
        "conn-state-invalidated",
    ),
    _info(
        Status.OPAQUE_NO_MATCH,
        "OPAQUE_NO_MATCH",
        "Opaque does not match",
        "conn-state-invalidated",
    ),
    _info(Status.NOT_LOCKED, "NOT_LOCKED", "Requested resource is not locked", "item-only"),
    _info(
        Status.AUTH_STALE,
        "AUTH_STALE",
        "Reauthentication required",
        "conn-state-invalidated",
        "auth",
    ),
    _info(
        Status.AUTH_ERROR,
        "AUTH_ERROR",
        "Authentication failed",
        "conn-state-invalidated",
        "auth",
    ),
    _info(
        Status.AUTH_CONTINUE,
        "AUTH_CONTINUE",
        "Continue authentication processs",
        "special-handling",
    ),
    _info(Status.ERANGE, "ERANGE", "Invalid range requested", "invalid-input"),
    _info(Status.ROLLBACK, "ROLLBACK", "Rollback", "dcp", "special-handling"),
    _info(Status.EACCESS, "EACCESS", "Not authorized for command", "support"),
    _info(
        Status.NOT_INITIALIZED,
        "NOT_INITIALIZED",
        "Server not initialized",
        "conn-state-invalidated",
    ),
    _info(
        Status.BUCKET_PAUSED,
        "BUCKET_PAUSED",
        "The request is not possible because the bucket is paused",
        "support",
    ),
    _info(
        Status.UNKNOWN_FRAME_INFO,
        "UNKNOWN_FRAME_INFO",
        "Unknown frame info identifier encountered. Maybe a newer server version knows about it",
        "support",
    ),
    _info(
        Status.UNKNOWN_COMMAND,
        "UNKNOWN_COMMAND",
        "Unknown command. Maybe a newer server version knows about it",
        "support",
    ),
    _info(
        Status.ENOMEM,
        "ENOMEM",
        "No memory available to store item. Add memory or remove some items and try later",
        "temp",
        "retry-later",
    ),
    _info(
        Status.NOT_SUPPORTED,
        "NOT_SUPPORTED",
        "Command not supported with current bucket type/configuration",
        "support",
    ),
    _info(
        Status.EINTERNAL,
        "EINTERNAL",
        "Internal error. Reconnect recommended",
        "internal",
        "conn-state-invalidated",
    ),
    _info(Status.EBUSY, "EBUSY", "Busy, try again", "temp", "retry-now"),
    _info(Status.ETMPFAIL, "ETMPFAIL", "Temporary failure. Try again", "temp", "retry-now"),
    _info(Status.XATTR_EINVAL, "XATTR_EINVAL", "Invalid extended attribute", "invalid-input"),
    _info(
        Status.UNKNOWN_COLLECTION,
        "UNKNOWN_COLLECTION",
        "Operation specified an unknown collection.",
        "invalid-input",
    ),
    _info(
        Status.COLLECTIONS_MANIFEST_IS_AHEAD,
        "COLLECTIONS_MANIFEST_IS_AHEAD",
        "The collections manifest the request names is ahead of the node's.",
        "temp",
        "retry-later",
    ),
    _info(
        Status.UNKNOWN_SCOPE,
        "UNKNOWN_SCOPE",
        "Operation specified an unknown scope.",
        "invalid-input",
    ),
    _info(
        Status.DCP_STREAM_ID_INVALID,
        "DCP stream-ID invalid",
        "Operations stream-ID usage is incorrect.",
        "invalid-input",
    ),
    _info(
        Status.DURABILITY_INVALID_LEVEL,
        "DurabilityInvalidLevel",
        "Durability level is invalid",
        "invalid-input",
    ),
    _info(
        Status.DURABILITY_IMPOSSIBLE,
        "DurabilityImpossible",
        "Durability requirements are impossible to achieve",
        "item-only",
        "invalid-input",
    ),
    _info(
        Status.SYNC_WRITE_IN_PROGRESS,
        "SyncWriteInProgress",
        "The requested key has a pending synchronous write",
        "item-only",
        "retry-later",
    ),
    _info(
        Status.SYNC_WRITE_AMBIGUOUS,
        "SyncWriteAmbiguous",
        "The SyncWrite request has not completed in the specified time and has ambiguous "
        "result - it may Succeed or Fail; but the final value is not yet known",
        "item-only",
    ),
    _info(
        Status.SUBDOC_PATH_ENOENT,
        "SUBDOC_PATH_ENOENT",
        "Subdoc: Path not found in document",
        "subdoc",
        "item-only",
    ),
    _info(
        Status.SUBDOC_PATH_MISMATCH,
        "SUBDOC_PATH_MISMATCH",
        "Subdoc: Path and document disagree on structure",
        "subdoc",
        "item-only",
    ),
    _info(
        Status.SUBDOC_PATH_EINVAL,
        "SUBDOC_PATH_EINVAL",
        "Subdoc: Invalid path (bad syntax or unacceptable semantics for command",
        "subdoc",
        "invalid-input",
    ),
    _info(
        Status.SUBDOC_PATH_E2BIG,
        "SUBDOC_PATH_E2BIG",
        "Subdoc: Path size exceeds limit",
        "subdoc",
        "invalid-input",
    ),
    _info(
        Status.SUBDOC_DOC_E2DEEP,
        "SUBDOC_PATH_E2DEEP",
        "Subdoc: Path is too deep to be parsed",
        "subdoc",
        "invalid-input",
    ),
    _info(
        Status.SUBDOC_VALUE_CANTINSERT,
        "SUBDOC_VALUE_CANTINSERT",
        "Subdoc: Value invalid for insertion",
        "subdoc",
        "invalid-input",
    ),
    _info(
        Status.SUBDOC_DOC_NOTJSON,
        "SUBDOC_DOC_NOTJSON",
        "Subdoc: Document not JSON",
        "subdoc",
        "item-only",
    ),
    _info(
        Status.SUBDOC_NUM_ERANGE,
        "SUBDOC_NUM_ERANGE",
        "Subdoc: Existing numeric value is not within range",
        "subdoc",
        "item-only",
    ),
    _info(
        Status.SUBDOC_DELTA_EINVAL,
        "SUBDOC_DELTA_EINVAL",
        "Subdoc: Invalid value passed for delta (out of range, or not an integer",
        "subdoc",
        "item-only",
    ),
    _info(
        Status.SUBDOC_PATH_EEXISTS,
        "SUBDOC_PATH_EEXISTS",
        "Subdoc: Path already exists",
        "subdoc",
        "item-only",
    ),
    _info(
        Status.SUBDOC_VALUE_ETOODEEP,
        "SUBDOC_VALUE_ETOODEEP",
        "Subdoc: Value is too deep, or would make the document too deep",
        "subdoc",
        "invalid-input",
        "item-only",
    ),
    _info(
        Status.SUBDOC_INVALID_COMBO,
        "SUBDOC_INVALID_COMBO",
        "Subdoc: Lookup and mutation commands found within single packet",
        "subdoc",
        "invalid-input",
    ),
    _info(
        Status.SUBDOC_MULTI_PATH_FAILURE,
        "SUBDOC_MULTI_PATH_FAILURE",
        "Subdoc: Some (or all) commands failed. Inspect payload for details",
        "subdoc",
        "special-handling",
    ),
    _info(
        Status.SUBDOC_SUCCESS_DELETED,
        "SUBDOC_SUCCESS_DELETED",
        "Subdoc: Success, but the affected document was (and still is) deleted",
        "item-deleted",
        "success",
        "subdoc",
    ),
    _info(
        Status.SUBDOC_XATTR_INVALID_FLAG_COMBO,
        "SUBDOC_XATTR_INVALID_FLAG_COMBO",
        "Subdoc: The flag combination doesn't make any sense",
        "subdoc",
        "invalid-input",
    ),
    _info(
        Status.SUBDOC_XATTR_INVALID_KEY_COMBO,
        "SUBDOC_XATTR_INVALID_KEY_COMBO",
        "Subdoc: The key combination of the xattrs is not allowed",
        "subdoc",
        "invalid-input",
    ),
    _info(
        Status.SUBDOC_XATTR_UNKNOWN_MACRO,
        "SUBDOC_XATTR_UNKNOWN_MACRO",
        "Subdoc: The server don't know about the specified macro",
        "subdoc",
        "invalid-input",
    ),
    _info(
        Status.SUBDOC_XATTR_UNKNOWN_VATTR,
        "SUBDOC_XATTR_UNKNOWN_VATTR",
        "Subdoc: The server don't know about the specified virtual attribute",
        "subdoc",
        "invalid-input",
    ),
    _info(
        Status.SUBDOC_XATTR_CANT_MODIFY_VATTR,
        "SUBDOC_XATTR_CANT_MODIFY_VATTR",
        "Subdoc: Can't modify virtual attributes",
        "subdoc",
        "invalid-input",
    ),
    _info(
        Status.SUBDOC_MULTI_PATH_FAILURE_DELETED,
        "SUBDOC_MULTI_PATH_FAILURE_DELETED",
        "Subdoc: One or more paths in a multi-path command failed on a deleted document",
        "item-deleted",
        "subdoc",
        "special-handling",
    ),
    _info(
        Status.SUBDOC_INVALID_XATTR_ORDER,
        "SUBDOC_INVALID_XATTR_ORDER",
        "Subdoc: Invalid XATTR order (xattrs should come first)",
        "subdoc",
        "invalid-input",
    ),
)
BY_CODE: Final[dict[int, ErrorInfo]] = {info.code: info for info in ERRORS}

assert len(BY_CODE) == len(ERRORS), "a status is described twice"
assert set(BY_CODE) == {int(s) for s in Status}, set(BY_CODE) ^ {int(s) for s in Status}
assert all(set(info.attrs) <= V2_ATTRIBUTES and info.attrs for info in ERRORS)


def error_map_json(version: int) -> bytes | None:
    """The map for a client that understands up to ``version``; None for version 0 (none)."""
    if version == 0:
        return None
    served = min(version, VERSION_MAX)
    allowed = V1_ATTRIBUTES if served == 1 else V2_ATTRIBUTES
    errors = {
        f"{info.code:x}": {
            "name": info.name,
            "desc": info.desc,
            "attrs": [a for a in info.attrs if a in allowed],
        }
        for info in ERRORS
    }
    revision = REVISION if served == 2 else 4 + REVISION
    return json.dumps({"version": served, "revision": revision, "errors": errors}).encode()


# -- wire -----------------------------------------------------------------------------------


def encode_get_error_map(opaque: int, version: int = VERSION_MAX) -> bytes:
    return encode_request(Opcode.GET_ERROR_MAP, opaque=opaque, value=_VERSION.pack(version))


def decode_get_error_map(frame: Frame) -> int:
    """The version a GET_ERROR_MAP request asks for.

    Raises:
        ProtocolError: extras or a key, a vbucket other than 0, or a value that is not a u16
            (EINVAL, as kv_engine's validator).
    """
    if frame.extras or frame.key:
        raise ProtocolError("GET_ERROR_MAP takes no extras and no key")
    if frame.vbucket != 0:
        raise ProtocolError("GET_ERROR_MAP: request vbucket id must be 0")
    if len(frame.value) != _VERSION.size:
        raise ProtocolError(f"GET_ERROR_MAP value of {len(frame.value)} bytes, not 2")
    return int(_VERSION.unpack(frame.value)[0])


def decode_error_map(value: bytes) -> tuple[int, int, dict[int, ErrorInfo]]:
    """A node's error map (a peer's bytes): (version, revision, entries by status code).

    Raises:
        ProtocolError: not JSON, or an entry without its name, description or attribute list.
    """
    try:
        raw = json.loads(value)
    except (ValueError, RecursionError) as error:  # a 5000-digit number is a ValueError too
        raise ProtocolError(f"error map is not JSON: {error}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("errors"), dict):
        raise ProtocolError("error map lacks its errors object")
    version, revision = raw.get("version"), raw.get("revision")
    if type(version) is not int or type(revision) is not int:
        raise ProtocolError("error map lacks an integer version and revision")
    entries: dict[int, ErrorInfo] = {}
    for key, entry in raw["errors"].items():
        try:
            code = int(key, 16)
        except ValueError:
            raise ProtocolError(f"error map key {key[:16]!r} is not hex") from None
        if not 0 <= code <= 0xFFFF or not isinstance(entry, dict):
            raise ProtocolError(f"error map entry {key[:16]!r} is not a u16 status object")
        name, desc, attrs = entry.get("name"), entry.get("desc"), entry.get("attrs")
        if not isinstance(name, str) or not isinstance(desc, str) or not isinstance(attrs, list):
            raise ProtocolError(f"error map entry {key[:16]!r} lacks name, desc or attrs")
        if not all(isinstance(a, str) for a in attrs):
            raise ProtocolError(f"error map entry {key[:16]!r} has a non-string attribute")
        entries[code] = ErrorInfo(code, name, desc, tuple(attrs))
    return version, revision, entries
