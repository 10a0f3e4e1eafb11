"""Privileges: every command the server handles has a decided need, and roles grant what
Couchbase's roles of the same name grant."""

from __future__ import annotations

import pytest

from changefeed.protocol.opcode import Opcode
from changefeed.server.connection import HANDLERS
from changefeed.server.privileges import (
    DEFAULT_ROLES,
    OPCODE_PRIVILEGES,
    ROLE_PRIVILEGES,
    Privilege,
    privileges_of,
    required_privilege,
)


def test_every_handled_opcode_has_a_decided_privilege() -> None:
    undecided = {Opcode(op).name for op in HANDLERS} - {Opcode(op).name for op in OPCODE_PRIVILEGES}
    stale = {Opcode(op).name for op in OPCODE_PRIVILEGES} - {Opcode(op).name for op in HANDLERS}
    assert not undecided, f"add these opcodes to OPCODE_PRIVILEGES: {sorted(undecided)}"
    assert not stale, f"OPCODE_PRIVILEGES names opcodes nobody handles: {sorted(stale)}"


@pytest.mark.parametrize(
    ("opcode", "privilege"),
    [
        (Opcode.GET, Privilege.READ),
        (Opcode.OBSERVE_SEQNO, Privilege.READ),
        (Opcode.SEQNO_PERSISTENCE, Privilege.READ),
        (Opcode.GET_ALL_VB_SEQNOS, Privilege.READ),
        (Opcode.GET_FAILOVER_LOG, Privilege.READ),
        (Opcode.STAT, Privilege.STATS),
        (Opcode.SET, Privilege.WRITE),
        (Opcode.ADD, Privilege.WRITE),
        (Opcode.REPLACE, Privilege.WRITE),
        (Opcode.DELETE, Privilege.WRITE),
        (Opcode.DCP_OPEN, Privilege.DCP_STREAM),
        (Opcode.DCP_STREAM_REQ, Privilege.DCP_STREAM),
        (Opcode.DCP_CONTROL, Privilege.DCP_STREAM),
        (Opcode.DCP_CLOSE_STREAM, Privilege.DCP_STREAM),
        (Opcode.DCP_GET_FAILOVER_LOG, Privilege.DCP_STREAM),
        (Opcode.DCP_BUFFER_ACKNOWLEDGEMENT, Privilege.DCP_STREAM),
        (Opcode.DCP_NOOP, Privilege.DCP_STREAM),
        (Opcode.HELLO, None),
        (Opcode.NOOP, None),
        (Opcode.SASL_LIST_MECHS, None),
        (Opcode.SASL_AUTH, None),
        (Opcode.SASL_STEP, None),
        (Opcode.SELECT_BUCKET, None),
        (Opcode.GET_CLUSTER_CONFIG, None),
        (Opcode.COMPACT_DB, Privilege.ADMIN),
    ],
)
def test_each_command_needs_its_privilege(opcode: Opcode, privilege: Privilege | None) -> None:
    assert required_privilege(opcode) is privilege


def test_a_command_nobody_classified_needs_admin() -> None:
    assert Opcode.DCP_ADD_STREAM not in OPCODE_PRIVILEGES
    assert required_privilege(Opcode.DCP_ADD_STREAM) is Privilege.ADMIN
    assert required_privilege(0xEE) is Privilege.ADMIN


def allowed(roles: list[str]) -> set[Opcode]:
    """Opcodes a user with ``roles`` may send once authenticated."""
    granted = privileges_of(roles)
    return {
        Opcode(op)
        for op in HANDLERS
        if (needed := required_privilege(op)) is None or needed in granted
    }


def test_roles_grant_what_couchbase_roles_grant() -> None:
    assert ROLE_PRIVILEGES["admin"] == frozenset(Privilege)
    assert ROLE_PRIVILEGES["data_reader"] == {Privilege.READ}
    assert ROLE_PRIVILEGES["data_writer"] == {Privilege.WRITE}  # as in Couchbase: no reads
    assert ROLE_PRIVILEGES["data_dcp_reader"] == {Privilege.READ, Privilege.DCP_STREAM}
    assert ROLE_PRIVILEGES["data_monitoring"] == {Privilege.STATS}
    assert DEFAULT_ROLES == ("admin",)


# The Couchbase SDKs' KV surface (server/kv_commands.py, server/subdoc.py; kv_engine's
# mcbp_privileges.cc). GAT and the counters also need READ, checked by their handlers.
SDK_READS = {
    Opcode.GET_META, Opcode.GET_LOCKED, Opcode.UNLOCK_KEY, Opcode.SUBDOC_MULTI_LOOKUP,
}  # fmt: skip
SDK_WRITES = {
    Opcode.TOUCH, Opcode.GAT, Opcode.INCREMENT, Opcode.DECREMENT, Opcode.APPEND, Opcode.PREPEND,
    Opcode.SUBDOC_MULTI_MUTATION,
}  # fmt: skip


def test_what_each_role_may_send() -> None:
    everyone = {op for op in map(Opcode, HANDLERS) if required_privilege(op) is None}
    assert allowed(["admin"]) == set(map(Opcode, HANDLERS))
    assert allowed(["data_reader"]) - everyone - SDK_READS == {
        Opcode.GET, Opcode.GET_REPLICA, Opcode.OBSERVE_SEQNO, Opcode.SEQNO_PERSISTENCE,
        Opcode.GET_ALL_VB_SEQNOS, Opcode.GET_FAILOVER_LOG,
    }  # fmt: skip
    assert allowed(["data_writer"]) - everyone - SDK_WRITES == {
        Opcode.SET, Opcode.ADD, Opcode.REPLACE, Opcode.DELETE,
    }  # fmt: skip
    assert allowed(["data_reader"]) >= SDK_READS
    assert allowed(["data_writer"]) >= SDK_WRITES
    assert not SDK_WRITES & allowed(["data_reader"]) and not SDK_READS & allowed(["data_writer"])
    dcp = allowed(["data_dcp_reader"]) - everyone
    assert Opcode.DCP_OPEN in dcp
    assert Opcode.GET in dcp
    assert not dcp & {Opcode.SET, Opcode.DELETE, Opcode.STAT}
    assert allowed(["data_monitoring"]) - everyone == {Opcode.STAT}
    for role in ROLE_PRIVILEGES.keys() - {"admin"}:
        assert Opcode.COMPACT_DB not in allowed([role]), role
    assert allowed(["data_reader", "data_writer"]) == allowed(["data_reader"]) | allowed(
        ["data_writer"]
    )


def test_an_unknown_role_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown role 'superuser'; roles are admin, data_reader"):
        privileges_of(["data_reader", "superuser"])
    assert privileges_of([]) == frozenset()
