"""Connections to a test node: KV and DCP clients, a bare connection, STAT, retried writes.

Every connection goes to 127.0.0.1 with the node's default credentials, and sets itself up
with ``changefeed.consumer.handshake`` (``raw_connection(auth=False)`` stops after HELLO on
purpose, for tests of unauthenticated peers).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from typing import Any

from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.consumer import ClientConfig, KvClient
from changefeed.consumer.connection import Connection
from changefeed.consumer.handshake import connect, hello
from changefeed.consumer.kv_client import Durability
from changefeed.protocol.errors import TemporaryFailureError
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Feature, Opcode
from changefeed.protocol.status import Status

USER = "Administrator"
PASSWORD = "password"
BUCKET = "default"
AGENT = "changefeed-tests"
FEATURES = (Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON)
TMPFAIL_RETRIES_MAX = 400  # ~20 s of backoff per chunk at most
UPSERT_CHUNK = 1000


def free_port() -> int:
    """A loopback port that was free a moment ago (for --metrics-port, a Spark master...; a
    node's KV port comes from its ready file instead)."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


async def kv_connect(node: NodeProcess, **kwargs: Any) -> KvClient:
    """A ``KvClient`` on ``node``; ``kwargs`` go to ``KvClient.connect`` (user, password...)."""
    return await KvClient.connect(HOST, node.port, **kwargs)


_client_numbers = itertools.count(1)


def dcp_config(node: NodeProcess, **overrides: Any) -> ClientConfig:
    """A ``ClientConfig`` for ``node`` streaming to the latest seqno, with a unique name."""
    # A unique name: a DCP name reused by a new connection kicks the older one (dcp-wire.md §4).
    name = f"{AGENT}:{next(_client_numbers)}"
    values: dict[str, Any] = {"host": HOST, "port": node.port, "to_latest": True, "name": name}
    values.update(overrides)
    return ClientConfig(**values)


async def upsert_retrying(
    kv: KvClient,
    items: list[tuple[bytes, bytes]],
    *,
    chunk: int = UPSERT_CHUNK,
    durability: Durability = "none",
) -> None:
    """``upsert_many`` in chunks, retrying a chunk on TMPFAIL (checkpoint memory full: the
    flusher catches up meanwhile).

    Raises:
        TimeoutError: a chunk still got TMPFAIL after ``TMPFAIL_RETRIES_MAX`` attempts.
    """
    for first in range(0, len(items), chunk):
        part = items[first : first + chunk]
        for attempt in range(TMPFAIL_RETRIES_MAX):
            try:
                await kv.upsert_many(part, durability=durability)
                break
            except TemporaryFailureError:
                await asyncio.sleep(min(0.05, 0.001 * (attempt + 1)))
        else:
            raise TimeoutError("writes kept failing with TMPFAIL")


async def raw_connection(node: NodeProcess, *, auth: bool = True) -> Connection:
    """A bare connection after the handshake; with ``auth=False`` after HELLO only."""
    if auth:
        return await connect(
            HOST, node.port, agent=AGENT, user=USER, password=PASSWORD, bucket=BUCKET,
            features=FEATURES,
        )  # fmt: skip
    conn = await Connection.open(HOST, node.port)
    try:
        await hello(conn, AGENT, list(FEATURES))
    except BaseException:
        await conn.close()
        raise
    return conn


async def stats(conn: Connection, group: str, *, timeout_s: float = 10.0) -> dict[str, str]:
    """STAT ``group``: the multi-response answer up to the empty terminator (or an error)."""
    opaque = conn.next_opaque()
    request = encode_request(Opcode.STAT, opaque=opaque, key=group.encode())
    frames = await conn.request_many(
        request, opaque, lambda f: f.status != Status.SUCCESS or not f.key, timeout_s=timeout_s
    )
    status = frames[-1].status
    assert status == Status.SUCCESS, f"STAT {group!r} answered status {status:#x}"
    return {f.key.decode(): f.value.decode() for f in frames[:-1]}


async def node_stats(node: NodeProcess, group: str = "") -> dict[str, str]:
    """STAT ``group`` of ``node`` over a connection of its own."""
    conn = await raw_connection(node)
    try:
        return await stats(conn, group)
    finally:
        await conn.close()


async def high_seqnos(node: NodeProcess) -> dict[int, int]:
    """Each vbucket's high seqno, as the node's ``STAT vbucket-seqno`` says (a truth reader)."""
    conn = await raw_connection(node)
    try:
        answer = await stats(conn, "vbucket-seqno")
    finally:
        await conn.close()
    return {vb: int(answer[f"vb_{vb}:high_seqno"]) for vb in range(node.vbuckets)}
