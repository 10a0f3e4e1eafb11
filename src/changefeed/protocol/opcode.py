"""Magic bytes, opcodes, datatype bits and HELLO features (dcp-wire.md §1.2, §1.4, §1.6, §2).

Plain enumerations; no behaviour. Opcodes this project does not implement are still named when
the reference lists them, so that a log line says ``DCP_PREPARE`` rather than ``0x60``.
"""

from __future__ import annotations

from enum import IntEnum, IntFlag


class Magic(IntEnum):
    """First header byte: direction and header flavour."""

    REQUEST = 0x80
    RESPONSE = 0x81
    ALT_REQUEST = 0x08  # request with framing extras (e.g. DCP stream-id)
    ALT_RESPONSE = 0x18  # response with framing extras
    SERVER_REQUEST = 0x82  # duplex; not used by DCP
    SERVER_RESPONSE = 0x83

    @property
    def is_request(self) -> bool:
        return self in (Magic.REQUEST, Magic.ALT_REQUEST, Magic.SERVER_REQUEST)

    @property
    def is_alt(self) -> bool:
        return self in (Magic.ALT_REQUEST, Magic.ALT_RESPONSE)


class Opcode(IntEnum):
    """Command opcodes: the KV commands a Couchbase-style client needs, then the DCP family."""

    GET = 0x00
    SET = 0x01
    ADD = 0x02
    REPLACE = 0x03
    DELETE = 0x04
    INCREMENT = 0x05
    DECREMENT = 0x06
    QUIT = 0x07
    NOOP = 0x0A
    APPEND = 0x0E
    PREPEND = 0x0F
    STAT = 0x10
    TOUCH = 0x1C
    GAT = 0x1D  # get and touch
    HELLO = 0x1F
    SASL_LIST_MECHS = 0x20
    SASL_AUTH = 0x21
    SASL_STEP = 0x22
    COMPACT_DB = 0x3A  # kv_engine: compact one vbucket now, answered when done
    GET_ALL_VB_SEQNOS = 0x48
    DCP_OPEN = 0x50
    DCP_ADD_STREAM = 0x51
    DCP_CLOSE_STREAM = 0x52
    DCP_STREAM_REQ = 0x53
    DCP_GET_FAILOVER_LOG = 0x54
    DCP_STREAM_END = 0x55
    DCP_SNAPSHOT_MARKER = 0x56
    DCP_MUTATION = 0x57
    DCP_DELETION = 0x58
    DCP_EXPIRATION = 0x59
    DCP_FLUSH = 0x5A
    DCP_SET_VBUCKET_STATE = 0x5B
    DCP_NOOP = 0x5C
    DCP_BUFFER_ACKNOWLEDGEMENT = 0x5D
    DCP_CONTROL = 0x5E
    DCP_SYSTEM_EVENT = 0x5F
    DCP_PREPARE = 0x60
    DCP_SEQNO_ACKNOWLEDGED = 0x61
    DCP_COMMIT = 0x62
    DCP_ABORT = 0x63
    DCP_SEQNO_ADVANCED = 0x64
    DCP_OSO_SNAPSHOT = 0x65
    GET_REPLICA = 0x83  # a read of a replica copy (the SDK's get_any_replica)
    SELECT_BUCKET = 0x89
    OBSERVE_SEQNO = 0x91
    GET_LOCKED = 0x94
    UNLOCK_KEY = 0x95
    GET_FAILOVER_LOG = 0x96
    GET_META = 0xA0
    GET_CLUSTER_CONFIG = 0xB5
    SET_COLLECTIONS_MANIFEST = 0xB9  # collections (server/collection_commands.py)
    GET_COLLECTIONS_MANIFEST = 0xBA
    GET_COLLECTION_ID = 0xBB
    GET_SCOPE_ID = 0xBC
    SEQNO_PERSISTENCE = 0xB6  # answered once the vbucket persisted the seqno in the extras
    # Sub-document: single-path opcodes (also the operation codes inside a multi-path request,
    # where GET 0x00, SET 0x01 and DELETE 0x04 are the whole-document operations).
    SUBDOC_GET = 0xC5
    SUBDOC_EXISTS = 0xC6
    SUBDOC_DICT_ADD = 0xC7
    SUBDOC_DICT_UPSERT = 0xC8
    SUBDOC_DELETE = 0xC9
    SUBDOC_REPLACE = 0xCA
    SUBDOC_ARRAY_PUSH_LAST = 0xCB
    SUBDOC_ARRAY_PUSH_FIRST = 0xCC
    SUBDOC_ARRAY_INSERT = 0xCD
    SUBDOC_ARRAY_ADD_UNIQUE = 0xCE
    SUBDOC_COUNTER = 0xCF
    SUBDOC_MULTI_LOOKUP = 0xD0
    SUBDOC_MULTI_MUTATION = 0xD1
    SUBDOC_GET_COUNT = 0xD2
    GET_ERROR_MAP = 0xFE


class ServerOpcode(IntEnum):
    """Opcodes of requests a server sends its client (magic SERVER_REQUEST, duplex)."""

    CLUSTERMAP_CHANGE_NOTIFICATION = 0x01


class Datatype(IntFlag):
    """Header byte 5: what the value bytes are. Bits above 0x07 are invalid."""

    RAW = 0x00
    JSON = 0x01
    SNAPPY = 0x02
    XATTR = 0x04


DATATYPE_MASK = 0x07


class Feature(IntEnum):
    """HELLO feature codes (u16)."""

    TLS = 0x02
    TCP_NODELAY = 0x03
    MUTATION_SEQNO = 0x04
    XATTR = 0x06
    XERROR = 0x07
    SELECT_BUCKET = 0x08
    SNAPPY = 0x0A
    JSON = 0x0B
    DUPLEX = 0x0C
    CLUSTERMAP_CHANGE_NOTIFICATION = 0x0D
    UNORDERED_EXECUTION = 0x0E
    TRACING = 0x0F
    ALT_REQUEST_SUPPORT = 0x10
    SYNC_REPLICATION = 0x11
    COLLECTIONS = 0x12
    SNAPPY_EVERYWHERE = 0x13
    PRESERVE_TTL = 0x14
    VATTR = 0x15
    SUBDOC_CREATE_AS_DELETED = 0x17
    SUBDOC_DOCUMENT_MACRO_SUPPORT = 0x18
    SUBDOC_REPLICA_READ = 0x1C
    DEDUPE_NOT_MY_VBUCKET_CLUSTERMAP = 0x1E
    CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF = 0x1F
    SUBDOC_BINARY_XATTR = 0x21
