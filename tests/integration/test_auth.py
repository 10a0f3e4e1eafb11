"""Authentication against a live node: bad credentials fail, unauthenticated commands are refused,
and the node keeps serving everyone else."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import socket
import stat

import pytest
from scramp import ScramClient

from changefeed.cli.node_process import NodeProcess
from changefeed.consumer import ClientConfig, DcpClient
from changefeed.consumer.connection import Connection
from changefeed.consumer.handshake import connect
from changefeed.protocol.errors import AccessError, AuthError, error_for_status
from changefeed.protocol.frame import Frame
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Feature, Opcode
from changefeed.protocol.sasl import SCRAMP_NAMES, encode_plain
from changefeed.protocol.status import Status
from changefeed.server.authenticator import (
    AUTH_FAILURES_PER_WINDOW_MAX,
    AUTH_LOG_LINES_PER_WINDOW_MAX,
)
from changefeed.server.users import NODE_SECRET_FILE, Users
from support.clients import HOST, dcp_config, kv_connect, raw_connection
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(180)

REPLY_TIMEOUT_S = 10.0


async def sasl(node: NodeProcess, mechanism: str, user: str, password: str) -> None:
    """Authenticate with exactly ``mechanism``; raises AuthError like the client library."""
    conn = await raw_connection(node, auth=False)
    try:
        if mechanism == "PLAIN":
            opaque = conn.next_opaque()
            request = encode_request(
                Opcode.SASL_AUTH, opaque=opaque, key=b"PLAIN", value=encode_plain(user, password)
            )
            response = await conn.request(request, opaque)
            if response.status != Status.SUCCESS:
                raise error_for_status(response.status, response.value.decode())
            return
        client = ScramClient([SCRAMP_NAMES[mechanism]], user, password)
        opaque = conn.next_opaque()
        first = await conn.request(
            encode_request(
                Opcode.SASL_AUTH, opaque=opaque, key=mechanism.encode(),
                value=client.get_client_first().encode(),
            ),
            opaque,
        )  # fmt: skip
        # Unknown users get a decoy salt: the first step succeeds for every name, so it does
        # not tell a caller which users exist; only the proof fails.
        assert first.status == Status.AUTH_CONTINUE, (user, hex(first.status))
        client.set_server_first(first.value.decode())
        opaque = conn.next_opaque()
        final = await conn.request(
            encode_request(
                Opcode.SASL_STEP, opaque=opaque, key=mechanism.encode(),
                value=client.get_client_final().encode(),
            ),
            opaque,
        )  # fmt: skip
        if final.status != Status.SUCCESS:
            raise error_for_status(final.status, final.value.decode())
        client.set_server_final(final.value.decode())
    finally:
        await conn.close()


def test_authentication(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=4)

    async def scenario() -> None:
        # The library's own path (best mechanism: SCRAM-SHA512) with a wrong password.
        with pytest.raises(AuthError):
            await kv_connect(node, password="wrong")
        with pytest.raises(AuthError):
            await kv_connect(node, user="nobody")
        with pytest.raises(AuthError):
            async with DcpClient(ClientConfig(HOST, node.port, password="Password")):
                pass
        # Every mechanism, wrong then right.
        for mechanism in ("SCRAM-SHA512", "SCRAM-SHA256", "PLAIN"):
            with pytest.raises(AuthError):
                await sasl(node, mechanism, "Administrator", "wrong")
            with pytest.raises(AuthError):
                await sasl(node, mechanism, "ghost", "password")
            await sasl(node, mechanism, "Administrator", "password")

        # Unauthenticated: GET, SET, STAT and DCP_OPEN get EACCESS; the connection stays usable.
        conn = await raw_connection(node, auth=False)
        try:
            for opcode, key in [
                (Opcode.GET, b"k"), (Opcode.SET, b"k"), (Opcode.STAT, b""),
                (Opcode.SELECT_BUCKET, b"default"), (Opcode.DCP_OPEN, b"x"),
            ]:  # fmt: skip
                opaque = conn.next_opaque()
                extras = b"\0" * 8 if opcode in (Opcode.SET, Opcode.DCP_OPEN) else b""
                response = await conn.request(
                    encode_request(opcode, opaque=opaque, key=key, extras=extras), opaque
                )
                assert response.status == Status.EACCESS, (opcode, hex(response.status))
            opaque = conn.next_opaque()
            response = await conn.request(encode_request(Opcode.NOOP, opaque=opaque), opaque)
            assert response.status == Status.SUCCESS
        finally:
            await conn.close()

        # A failed attempt leaves the connection unauthenticated but retryable.
        conn = await raw_connection(node, auth=False)
        try:
            opaque = conn.next_opaque()
            bad = encode_plain("Administrator", "nope")
            request = encode_request(Opcode.SASL_AUTH, opaque=opaque, key=b"PLAIN", value=bad)
            assert (await conn.request(request, opaque)).status == Status.AUTH_ERROR
            opaque = conn.next_opaque()
            request = encode_request(Opcode.GET, opaque=opaque, key=b"k")
            assert (await conn.request(request, opaque)).status == Status.EACCESS
        finally:
            await conn.close()

        # The node still serves.
        async with await kv_connect(node) as kv:
            await kv.upsert(b"after", b"auth")
            assert (await kv.get(b"after")).value == b"auth"

    asyncio.run(scenario())
    assert node.alive
    assert node.errors_in_log() == []


async def plain(conn: Connection, user: str, password: str) -> Frame:
    """One SASL_AUTH PLAIN on ``conn``; the response, whatever its status."""
    opaque = conn.next_opaque()
    request = encode_request(
        Opcode.SASL_AUTH, opaque=opaque, key=b"PLAIN", value=encode_plain(user, password)
    )
    return await conn.request(request, opaque, timeout_s=REPLY_TIMEOUT_S)


async def get_status(conn: Connection, key: bytes = b"k") -> int:
    opaque = conn.next_opaque()
    request = encode_request(Opcode.GET, opaque=opaque, key=key)
    return (await conn.request(request, opaque, timeout_s=REPLY_TIMEOUT_S)).status


async def scram_first_salt(node: NodeProcess, mechanism: str, user: str) -> bytes:
    """The salt of the node's first SCRAM reply to ``user``."""
    conn = await raw_connection(node, auth=False)
    try:
        client = ScramClient([SCRAMP_NAMES[mechanism]], user, "whatever")
        opaque = conn.next_opaque()
        request = encode_request(
            Opcode.SASL_AUTH, opaque=opaque, key=mechanism.encode(),
            value=client.get_client_first().encode(),
        )  # fmt: skip
        reply = await conn.request(request, opaque, timeout_s=REPLY_TIMEOUT_S)
        assert reply.status == Status.AUTH_CONTINUE, (user, hex(reply.status))
    finally:
        await conn.close()
    fields = dict(part.split("=", 1) for part in reply.value.decode().split(","))
    return base64.b64decode(fields["s"])


def test_a_plain_password_with_control_characters_fails_cleanly(nodes: NodeFactory) -> None:
    """Fuzzing found that SASLprep's refusal escaped as "Fatal error on transport"."""
    node = nodes(vbuckets=4)

    async def scenario() -> None:
        conn = await raw_connection(node, auth=False)
        try:
            for password in ("pass\x07word", "\x1b[2J", "\ue000"):
                reply = await plain(conn, "Administrator", password)
                assert reply.status == Status.AUTH_ERROR, (password, hex(reply.status))
            assert (await plain(conn, "Administrator", "password")).status == Status.SUCCESS
        finally:
            await conn.close()

    asyncio.run(scenario())
    assert node.errors_in_log() == []


def test_a_failed_reauth_drops_the_previous_identity(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=4)

    async def scenario() -> None:
        conn = await raw_connection(node, auth=False)
        try:
            assert (await plain(conn, "Administrator", "password")).status == Status.SUCCESS
            assert await get_status(conn) == Status.NO_BUCKET  # authenticated, no bucket yet
            assert (await plain(conn, "Administrator", "wrong")).status == Status.AUTH_ERROR
            assert await get_status(conn) == Status.EACCESS
        finally:
            await conn.close()

    asyncio.run(scenario())
    assert node.errors_in_log() == []


def test_scram_salts_do_not_tell_which_users_exist(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=4)

    async def scenario() -> None:
        for mechanism in ("SCRAM-SHA512", "SCRAM-SHA256"):
            known = await scram_first_salt(node, mechanism, "Administrator")
            unknown = await scram_first_salt(node, mechanism, "ghost")
            assert len(known) == len(unknown) == 32, (mechanism, known, unknown)
            # The same name gets the same fake salt on every attempt, as a real user does.
            assert await scram_first_salt(node, mechanism, "ghost") == unknown

    asyncio.run(scenario())


# Users of each role besides the node's admin (the password is the name reversed).
ROLE_USERS = {
    "reader": ["data_reader"],
    "writer": ["data_writer"],
    "streamer": ["data_dcp_reader"],
    "monitor": ["data_monitoring"],
}


def start_with_role_users(nodes: NodeFactory) -> NodeProcess:
    """A node whose users file holds the admin and one user of each of ROLE_USERS."""
    node = nodes(vbuckets=4, start=False)
    users = Users()
    users.add("Administrator", "password")
    for name, roles in ROLE_USERS.items():
        users.add(name, name[::-1], roles=roles)
    users.save(node.data_dir / "users.json")
    return node.start()


async def command_status(
    conn: Connection, opcode: Opcode, *, value: bytes = b"", extras: bytes = b""
) -> int:
    opaque = conn.next_opaque()
    request = encode_request(opcode, opaque=opaque, key=b"k", value=value, extras=extras)
    return (await conn.request(request, opaque, timeout_s=REPLY_TIMEOUT_S)).status


def test_commands_without_the_privilege_are_refused_with_eaccess(nodes: NodeFactory) -> None:
    node = start_with_role_users(nodes)
    set_extras = b"\0" * 8  # flags, expiry

    async def statuses(user: str) -> dict[str, int]:
        conn = await connect(
            HOST, node.port, agent="test-roles", user=user, password=user[::-1], bucket="default",
            features=[Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON],
        )  # fmt: skip
        try:
            opaque = conn.next_opaque()
            stat = encode_request(Opcode.STAT, opaque=opaque, key=b"")
            last = await conn.request_many(stat, opaque, lambda f: f.status != 0 or not f.key)
            return {
                "get": await command_status(conn, Opcode.GET),
                "set": await command_status(conn, Opcode.SET, value=b"v", extras=set_extras),
                "stat": last[-1].status,
            }
        finally:
            await conn.close()

    async def scenario() -> None:
        assert await statuses("reader") == {
            "get": Status.KEY_ENOENT, "set": Status.EACCESS, "stat": Status.EACCESS,
        }  # fmt: skip
        assert await statuses("writer") == {
            "get": Status.EACCESS, "set": Status.SUCCESS, "stat": Status.EACCESS,
        }  # fmt: skip
        assert await statuses("monitor") == {
            "get": Status.EACCESS, "set": Status.EACCESS, "stat": Status.SUCCESS,
        }  # fmt: skip
        assert (await statuses("streamer"))["set"] == Status.EACCESS
        # DCP: the DCP reader streams; a plain reader cannot open a producer.
        async with DcpClient(dcp_config(node, user="streamer", password="remaerts")):
            pass
        with pytest.raises(AccessError):
            async with DcpClient(dcp_config(node, user="reader", password="redaer")):
                pass
        # The admin may do everything.
        async with await kv_connect(node) as kv:
            await kv.upsert(b"k", b"v")
            assert (await kv.get(b"k")).value == b"v"

    asyncio.run(scenario())
    assert node.errors_in_log() == []


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (the node exempts loopback peers
    from throttling); a connection from it to 127.0.0.1 still goes over lo."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent, a route is chosen
        except OSError:
            return None
        address: str = probe.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def test_a_host_with_too_many_failures_is_refused_until_its_window_ends(
    nodes: NodeFactory,
) -> None:
    source = non_loopback_address()
    if source is None:
        pytest.skip("no non-loopback address to connect from")
    node = nodes(vbuckets=4)

    async def scenario() -> None:
        reader, writer = await asyncio.open_connection(HOST, node.port, local_addr=(source, 0))
        conn = Connection(reader, writer)
        try:
            for _ in range(AUTH_FAILURES_PER_WINDOW_MAX):
                reply = await plain(conn, "Administrator", "guess")
                assert reply.value == b"authentication failed", reply.value
            # Now even the right password is refused, without hashing, with a hint.
            reply = await plain(conn, "Administrator", "password")
            assert reply.status == Status.AUTH_ERROR, hex(reply.status)
            assert reply.value.startswith(b"too many failed attempts; retry in "), reply.value
        finally:
            await conn.close()
        # Other hosts are not throttled (loopback peers never are).
        async with await kv_connect(node) as kv:
            await kv.upsert(b"still", b"serving")

    asyncio.run(scenario())
    log = node.log_text()
    assert f"throttling {source}: {AUTH_FAILURES_PER_WINDOW_MAX} failed authentications" in log
    assert log.count("authentication failed from") <= AUTH_LOG_LINES_PER_WINDOW_MAX
    assert node.errors_in_log() == []


def test_fake_salts_survive_a_restart(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=4)
    salts = asyncio.run(scram_first_salt(node, "SCRAM-SHA512", "ghost"))
    secret = node.data_dir / NODE_SECRET_FILE
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    node.restart()
    assert asyncio.run(scram_first_salt(node, "SCRAM-SHA512", "ghost")) == salts
