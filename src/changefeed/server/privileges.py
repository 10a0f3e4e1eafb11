"""Who may do what: privileges, the Couchbase roles that grant them, and each command's need.

A user's roles (in the users file) grant a set of `Privilege`s; each opcode the server handles
needs at most one of them (`required_privilege`). The role names and what they grant follow
Couchbase (ns_server ``menelaus_roles.erl``), with its fine privileges folded into five coarse
ones; which command needs which follows kv_engine's ``mcbp_privileges.cc``.

What it does not do: check anything. The connection asks ``required_privilege(opcode)`` and
compares with the privileges its `SaslAuthenticator` holds; refusing with EACCESS is its job.
There are no per-collection or per-bucket roles (a node serves one bucket).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from changefeed.protocol.opcode import Opcode


class Privilege(enum.Enum):
    """What a command may need. Couchbase's finer privileges are named in the comments."""

    READ = "read"  # documents and their metadata: Read + MetaRead
    WRITE = "write"  # insert, upsert, delete documents: Insert + Upsert + Delete
    DCP_STREAM = "dcp_stream"  # open a DCP producer and stream from it: DcpProducer + DcpStream
    STATS = "stats"  # STAT groups: SimpleStats + Stats
    ADMIN = "admin"  # node management (COMPACT_DB); opcodes not classified need it too


# Couchbase's role names (`couchbase-cli user-manage --roles`), each with what it grants here.
# As in Couchbase, data_writer cannot read: a writer that waits for persistence (OBSERVE_SEQNO)
# also needs data_reader.
ROLE_PRIVILEGES: dict[str, frozenset[Privilege]] = {
    "admin": frozenset(Privilege),
    "data_reader": frozenset({Privilege.READ}),
    "data_writer": frozenset({Privilege.WRITE}),
    "data_dcp_reader": frozenset({Privilege.READ, Privilege.DCP_STREAM}),
    "data_monitoring": frozenset({Privilege.STATS}),
}

# A users-file entry written before roles existed has every privilege, as it had then; so has
# the admin user a node creates on first start.
DEFAULT_ROLES: tuple[str, ...] = ("admin",)

# The privilege each opcode the server handles needs; None: any peer that authenticated (the
# connection refuses everything but HELLO, SASL and NOOP before that). Kept equal to the
# connection's HANDLERS keys by tests/unit/server/test_privileges.py.
OPCODE_PRIVILEGES: dict[int, Privilege | None] = {
    Opcode.HELLO: None,
    Opcode.NOOP: None,
    Opcode.SASL_LIST_MECHS: None,
    Opcode.SASL_AUTH: None,
    Opcode.SASL_STEP: None,
    Opcode.SELECT_BUCKET: None,  # kv_engine: empty; every role is on the node's one bucket
    Opcode.GET_CLUSTER_CONFIG: None,  # kv_engine: "open to anyone"
    Opcode.GET: Privilege.READ,
    Opcode.GET_REPLICA: Privilege.READ,
    Opcode.GET_FAILOVER_LOG: Privilege.READ,  # kv_engine: Read
    Opcode.OBSERVE_SEQNO: Privilege.READ,  # kv_engine: MetaRead
    Opcode.SEQNO_PERSISTENCE: Privilege.READ,  # a wait for persistence, as OBSERVE_SEQNO
    Opcode.GET_ALL_VB_SEQNOS: Privilege.READ,  # kv_engine checks MetaRead in the engine
    Opcode.STAT: Privilege.STATS,  # kv_engine checks per group; every group here is stats
    Opcode.SET: Privilege.WRITE,
    Opcode.ADD: Privilege.WRITE,
    Opcode.REPLACE: Privilege.WRITE,
    Opcode.DELETE: Privilege.WRITE,
    Opcode.COMPACT_DB: Privilege.ADMIN,  # kv_engine: NodeManagement
    # The Couchbase SDKs' KV surface (server/kv_commands.py, server/subdoc.py). GAT and the
    # counters read as well as write: their handlers check READ too, as kv_engine does.
    Opcode.GET_ERROR_MAP: None,  # kv_engine: empty
    Opcode.GET_META: Privilege.READ,
    Opcode.GET_LOCKED: Privilege.READ,
    Opcode.UNLOCK_KEY: Privilege.READ,
    Opcode.TOUCH: Privilege.WRITE,
    Opcode.GAT: Privilege.WRITE,
    Opcode.INCREMENT: Privilege.WRITE,
    Opcode.DECREMENT: Privilege.WRITE,
    Opcode.APPEND: Privilege.WRITE,
    Opcode.PREPEND: Privilege.WRITE,
    Opcode.SUBDOC_MULTI_LOOKUP: Privilege.READ,
    Opcode.SUBDOC_MULTI_MUTATION: Privilege.WRITE,
    # Collections: reading the manifest is open to anyone (kv_engine: empty); changing it is
    # ns_server's (here the operator's `changefeed collection`), so ADMIN.
    Opcode.GET_COLLECTIONS_MANIFEST: None,
    Opcode.GET_COLLECTION_ID: None,
    Opcode.GET_SCOPE_ID: None,
    Opcode.SET_COLLECTIONS_MANIFEST: Privilege.ADMIN,
    # kv_engine checks DcpProducer when DCP_OPEN opens a producer (the only kind served here),
    # and lets NOOP, CONTROL and BUFFER_ACK through; here every DCP command needs DCP_STREAM,
    # so a connection whose identity changed after DCP_OPEN cannot go on streaming.
    Opcode.DCP_OPEN: Privilege.DCP_STREAM,
    Opcode.DCP_CONTROL: Privilege.DCP_STREAM,
    Opcode.DCP_STREAM_REQ: Privilege.DCP_STREAM,
    Opcode.DCP_CLOSE_STREAM: Privilege.DCP_STREAM,
    Opcode.DCP_GET_FAILOVER_LOG: Privilege.DCP_STREAM,
    Opcode.DCP_BUFFER_ACKNOWLEDGEMENT: Privilege.DCP_STREAM,
    Opcode.DCP_NOOP: Privilege.DCP_STREAM,
    Opcode.DCP_SEQNO_ACKNOWLEDGED: Privilege.DCP_STREAM,
}

assert frozenset(Privilege) == ROLE_PRIVILEGES["admin"]
assert all(role in ROLE_PRIVILEGES for role in DEFAULT_ROLES), DEFAULT_ROLES


def required_privilege(opcode: int) -> Privilege | None:
    """The privilege a request with ``opcode`` needs (None: being authenticated is enough).

    An opcode missing from `OPCODE_PRIVILEGES` needs ADMIN: a handler added without deciding
    its privilege is closed to everyone but admins, never open to every user.
    """
    return OPCODE_PRIVILEGES.get(opcode, Privilege.ADMIN)


def privileges_of(roles: Iterable[str]) -> frozenset[Privilege]:
    """The union of what ``roles`` grant.

    Raises:
        ValueError: a role is not one of `ROLE_PRIVILEGES` (the message lists them).
    """
    granted: set[Privilege] = set()
    for role in roles:
        privileges = ROLE_PRIVILEGES.get(role)
        if privileges is None:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLE_PRIVILEGES)}")
        granted |= privileges
    return frozenset(granted)
