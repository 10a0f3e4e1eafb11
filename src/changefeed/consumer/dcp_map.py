"""The cluster map a ``DcpClient`` routes by, and how it is kept fresh.

A ``MapFollower`` believes one map at a time and only ever moves to a newer one (a higher
``rev``): one a refusal carried in its body (``learn``), or one read again from a node
(``refresh``). It asks the node that last moved a stream first — that node acted on a map at
least as new as the move — then the bootstrap node, then any node of the map, and reads at most
once per ``MAP_REFRESH_INTERVAL_S`` (vbuckets refused together are retried at jittered times;
one read serves them all). Without a map (``follow_map=False``, or a node that serves none)
every vbucket routes to the bootstrap node.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from changefeed.consumer.connection import Connection
from changefeed.consumer.dcp_routing import read_cluster_config
from changefeed.consumer.handshake import call
from changefeed.protocol.errors import StatusError
from changefeed.protocol.opcode import Opcode
from changefeed.vbmap import ClusterMap

MAP_REFRESH_TIMEOUT_S = 5.0  # per node asked
MAP_REFRESH_INTERVAL_S = 0.1
Dialer = Callable[[str, int], Awaitable[Connection]]  # (host, port) -> a ready connection


class MapFollower:
    """Routes vbuckets to ``host:port`` servers by the newest map seen."""

    def __init__(self, host: str, port: int, dial: Dialer) -> None:
        self.cluster_map: ClusterMap | None = None
        self.bootstrap = f"{host}:{port}"  # the bootstrap node's name in the map, once read
        self._bootstrap_address = (host, port)
        self._dial = dial
        self._ask_first: str | None = None
        self._refreshed_at = float("-inf")

    async def read(self, conn: Connection) -> None:
        """Read the map on ``conn``, the bootstrap connection (GET_CLUSTER_CONFIG). A node
        that serves none (or not a usable one) leaves the follower without a map.

        Raises:
            ConnectionClosedError, TimeoutError: the connection failed.
        """
        try:
            config = json.loads((await call(conn, Opcode.GET_CLUSTER_CONFIG)).value)
            self.cluster_map, self.bootstrap = read_cluster_config(config, self.bootstrap)
        except (StatusError, ValueError):
            self.cluster_map = None

    def route(self, vb: int) -> str | None:
        """The server to stream ``vb`` from (None: the map places it nowhere)."""
        if self.cluster_map is None or not 0 <= vb < self.cluster_map.vbuckets:
            return self.bootstrap  # no map, or not in it: let the node answer for it
        active = self.cluster_map.active(vb)
        return None if active is None else active.server

    def address(self, server: str) -> tuple[str, int]:
        """Where to dial ``server``: the bootstrap node as configured (its map entry may name
        a bind address such as 0.0.0.0), any other as the map spells it."""
        if server == self.bootstrap:
            return self._bootstrap_address
        host, _, port = server.rpartition(":")
        return host, int(port)

    def learn(self, body: bytes) -> bool:
        """Adopt the map in ``body`` (a Couchbase config) when it is newer; True if it was."""
        try:
            found, _ = read_cluster_config(json.loads(body), "")
        except ValueError:  # not a map (JSONDecodeError is a ValueError)
            return False
        if self.cluster_map is not None and found.rev <= self.cluster_map.rev:
            return False
        self.cluster_map = found
        return True

    def moved_by(self, server: str) -> None:
        """``server`` refused or ended a stream: ask it first on the next refresh."""
        self._ask_first = server

    async def refresh(self) -> None:
        """Read the map again and adopt it when newer; keep the current one when no node
        answers (the next attempt asks again). No-op without a map."""
        loop = asyncio.get_running_loop()
        if self.cluster_map is None or loop.time() - self._refreshed_at < MAP_REFRESH_INTERVAL_S:
            return
        servers = [self.bootstrap, *(n.server for n in self.cluster_map.nodes)]
        if self._ask_first is not None:
            servers.insert(0, self._ask_first)
        for server in dict.fromkeys(servers):
            try:
                async with asyncio.timeout(MAP_REFRESH_TIMEOUT_S):
                    conn = await self._dial(*self.address(server))
                    try:
                        body = (await call(conn, Opcode.GET_CLUSTER_CONFIG)).value
                    finally:
                        await conn.close()
            except (OSError, TimeoutError, StatusError):  # OSError: ConnectionClosedError too
                continue
            self.learn(body)
            break
        self._refreshed_at = loop.time()
