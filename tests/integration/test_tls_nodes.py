"""Nodes authenticated by certificate on the TLS port, revocation, and certificate rotation
(issue 26, item 1): a node serving ``--tls-ca`` asks TLS clients for a certificate; a node
certificate the CA signed authenticates its connection as that node without SASL, SDK-style
clients without one still authenticate with a password, a certificate of another CA or one
the CRL lists is refused with one line on each side, and a rotated certificate is served to
new connections while the old ones and durable writes go on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import ssl
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography import x509

from changefeed.cli.main import cli
from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.consumer import KvClient
from changefeed.consumer.connection import (
    Connection,
    ConnectionClosedError,
    TlsError,
    client_tls_context,
)
from changefeed.consumer.handshake import call, connect
from changefeed.protocol.dcp import DcpOpen, OpenFlag, StreamRole, encode_dcp_open
from changefeed.protocol.errors import StatusError
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status
from support.clients import PASSWORD, USER, free_port, stats
from support.nodes import NodeFactory
from support.waiting import until

from .test_tls import make_certs

pytestmark = pytest.mark.timeout(120)


def cert_node(nodes: NodeFactory, certs: Path, *, crl: bool = True) -> tuple[NodeProcess, int]:
    """A node n0 with TLS and the cluster CA (and its CRL)."""
    tls_port = free_port()
    args = [
        "--no-durable", "--tls-port", str(tls_port), "--tls-cert", str(certs / "n0.pem"),
        "--tls-key", str(certs / "n0.key"), "--tls-ca", str(certs / "ca.pem"),
    ]  # fmt: skip
    if crl:
        args += ["--tls-crl", str(certs / "crl.pem")]
    return nodes(args=args), tls_port


def node_tls(certs: Path, node: str, ca: Path | None = None) -> ssl.SSLContext:
    """How node ``node`` dials: trusting the CA, presenting its certificate."""
    return client_tls_context(
        ca or certs / "ca.pem", cert_file=certs / f"{node}.pem", key_file=certs / f"{node}.key"
    )


async def node_connection(port: int, tls: ssl.SSLContext, name: str = "n2") -> Connection:
    """A connection authenticated by its certificate only (no SASL), as a replica feed's."""
    return await connect(
        HOST, port, agent=f"test:{name}", user=None, password="", bucket="default", tls=tls
    )


async def dcp_open_replica(conn: Connection, consumer: str) -> int:
    opaque = conn.next_opaque()
    message = DcpOpen(
        opaque, f"replication:n0->{consumer}:default", OpenFlag.PRODUCER,
        consumer_name=consumer, role=StreamRole.REPLICA,
    )  # fmt: skip
    request = encode_dcp_open(message)
    return (await conn.request(request, opaque)).status


async def connection_stats(port: int, certs: Path) -> dict[str, str]:
    conn = await connect(
        HOST, port, agent="test:stats", user=USER, password=PASSWORD, bucket="default",
        tls=client_tls_context(certs / "ca.pem"),
    )  # fmt: skip
    try:
        return await stats(conn, "connections")
    finally:
        await conn.close()


def served_serial(port: int, ca: Path) -> int:
    """The serial of the certificate a new TLS connection to ``port`` is shown."""
    context = client_tls_context(ca)
    with (
        socket.create_connection((HOST, port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=HOST) as secured,
    ):
        der = secured.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def reload(node: NodeProcess, port: int, certs: Path, reloads_before: int) -> None:
    """SIGHUP the node and wait until it says it reloaded its TLS files."""
    os.kill(node.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while int(asyncio.run(connection_stats(port, certs))["tls_reloads_total"]) <= reloads_before:
        assert time.monotonic() < deadline, "no TLS reload within 10 s of SIGHUP"
        time.sleep(0.1)


def test_a_node_certificate_authenticates_without_sasl_and_passwords_still_work(
    nodes: NodeFactory, tmp_path: Path
) -> None:
    certs = tmp_path / "certs"
    make_certs(certs, "n0", "n2")
    node, tls_port = cert_node(nodes, certs)

    async def scenario() -> None:
        conn = await node_connection(tls_port, node_tls(certs, "n2"))
        try:
            assert "curr_items" in await stats(conn, "")  # authenticated: no SASL was sent
            with pytest.raises(StatusError) as refused:  # a node certificate does not write
                await call(conn, Opcode.SET, key=b"k", extras=bytes(8), value=b"v")
            assert refused.value.status == Status.EACCESS
            assert await dcp_open_replica(conn, "n3") == Status.EACCESS  # not its name
            assert await dcp_open_replica(conn, "n2") == Status.SUCCESS
            counted = await connection_stats(tls_port, certs)
            assert counted["node_certificate_connections"] == "1", counted
        finally:
            await conn.close()
        # Clients without a certificate (the SDKs) authenticate with a password, on both ports.
        for port, tls_ca in ((tls_port, certs / "ca.pem"), (node.port, None)):
            async with await KvClient.connect(
                HOST, port, user=USER, password=PASSWORD, tls_ca=tls_ca
            ) as kv:
                await kv.upsert(b"k", b"password client")
                assert (await kv.get(b"k")).value == b"password client"
        # Without a certificate and without SASL nothing is served.
        bare = await Connection.open(HOST, tls_port, tls=client_tls_context(certs / "ca.pem"))
        try:
            with pytest.raises(StatusError) as refused:
                await call(bare, Opcode.STAT)
            assert refused.value.status == Status.EACCESS
        finally:
            await bare.close()

    asyncio.run(scenario())
    log = node.log_path.read_text()
    assert "authenticated as node n2 by its certificate" in log
    assert "Traceback" not in log


def test_a_certificate_of_another_ca_or_a_revoked_one_is_refused_with_one_line(
    nodes: NodeFactory, tmp_path: Path
) -> None:
    certs = tmp_path / "certs"
    make_certs(certs, "n0", "n2")
    make_certs(tmp_path / "other", "n2")
    node, tls_port = cert_node(nodes, certs)

    async def refused_with(tls: ssl.SSLContext) -> str:
        with pytest.raises((TlsError, ConnectionClosedError)) as refused:
            conn = await node_connection(tls_port, tls)
            await conn.close()  # not reached: the handshake's HELLO fails
        return str(refused.value)

    # A certificate another CA signed (it trusts our CA, so its side of the handshake passes).
    stranger = client_tls_context(
        certs / "ca.pem",
        cert_file=tmp_path / "other/n2.pem",
        key_file=tmp_path / "other/n2.key",
    )
    message = asyncio.run(refused_with(stranger))
    assert "\n" not in message and message.startswith("TLS: "), message
    assert "refused this node's certificate" in message or "unknown ca" in message, message

    # n2's certificate revoked: `certs revoke` writes the CRL, the node reloads it (SIGHUP) and
    # closes the connection n2's certificate opened before.
    async def revoke_while_connected() -> None:
        conn = await node_connection(tls_port, node_tls(certs, "n2"))
        try:
            result = CliRunner().invoke(cli, ["certs", "revoke", "--dir", str(certs), "n2"])
            assert result.exit_code == 0, result.output
            await asyncio.to_thread(reload, node, tls_port, certs, 0)
            async with asyncio.timeout(5):
                while conn.closed is None:  # bounded by the timeout
                    await asyncio.sleep(0.05)
        finally:
            await conn.close()

    asyncio.run(revoke_while_connected())
    message = asyncio.run(refused_with(node_tls(certs, "n2")))
    assert "\n" not in message and message.startswith("TLS: "), message
    assert "refused this node's certificate" in message or "revoked" in message, message

    # A new certificate for n2 (certs create again) is accepted: only the old serial is listed.
    make_certs(certs, "n2")

    async def accepted() -> None:
        conn = await node_connection(tls_port, node_tls(certs, "n2"))
        await conn.close()

    asyncio.run(accepted())
    lines = [x for x in node.log_path.read_text().splitlines() if "client certificate" in x]
    assert any("not signed by this node's --tls-ca" in x for x in lines), lines
    assert any("not accepted: certificate revoked" in x for x in lines), lines
    assert "closing ('127.0.0.1'" in node.log_path.read_text()  # "... n2's certificate ... revoked"
    assert "Traceback" not in node.log_path.read_text()


def test_a_rotated_certificate_serves_new_connections_while_durable_writes_go_on(
    nodes: NodeFactory, tmp_path: Path
) -> None:
    certs = tmp_path / "certs"
    make_certs(certs, "n0", "n2")
    node, tls_port = cert_node(nodes, certs)
    first = served_serial(tls_port, certs / "ca.pem")

    async def scenario() -> tuple[int, int]:
        written = 0
        kv = await KvClient.connect(
            HOST, tls_port, user=USER, password=PASSWORD, tls_ca=certs / "ca.pem"
        )
        replica = await node_connection(tls_port, node_tls(certs, "n2"))
        stop = asyncio.Event()

        async def writer() -> None:
            nonlocal written
            while not stop.is_set():  # bounded by the rotation below
                await kv.upsert(b"rot:%06d" % written, b"v", durability="persist")
                written += 1

        task = asyncio.create_task(writer())
        try:
            await asyncio.sleep(0.5)
            make_certs(certs, "n0")  # rotation: a new certificate and key, the same CA
            deadline = time.monotonic() + 15  # the node sees the files change (no signal)
            while await asyncio.to_thread(served_serial, tls_port, certs / "ca.pem") == first:
                assert time.monotonic() < deadline, "the new certificate was not served"
                await asyncio.sleep(0.2)
            # The writes went on through the rotation: one more ended after the new certificate
            # was served (each waits for a flush round, which takes a while under load).
            served = written
            await until(lambda: written, lambda n: n > served, "a durable write after the rotation")
            assert "curr_items" in await stats(replica, "")  # the node-authenticated one too
        finally:
            stop.set()
            await task  # raises if any durable write failed
            reconnects = kv.reconnects
            await kv.close()
            await replica.close()
        return written, reconnects

    written, reconnects = asyncio.run(scenario())
    assert reconnects == 0  # the connection opened before the rotation went on
    print(f"rotation: {written} durable writes, none failed; new serial served")
    log = node.log_path.read_text()
    assert "reloaded: new connections use it" in log and "Traceback" not in log
