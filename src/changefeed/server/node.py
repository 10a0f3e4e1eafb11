"""A node: one bucket, its listener, metrics, and an orderly shutdown.

``Node.run()`` opens the bucket (recovering from the data directory), listens for clients and
serves until SIGTERM/SIGINT, then stops accepting, ends DCP streams, flushes every vbucket and
closes the store cleanly, so a restart is a clean one (no new failover entry).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterator

from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.connection import ClientConnection
from changefeed.server.metrics import serve_metrics
from changefeed.server.users import Users, UsersError

log = logging.getLogger("changefeed.node")

DEFAULT_USER = "Administrator"


def load_or_create_users(config: NodeConfig) -> Users:
    """Load the users file; on first start create it with one admin user.

    The first user's password comes from ``CHANGEFEED_PASSWORD`` (default ``password``, logged
    as a warning so nobody runs with it unknowingly).
    """
    path = config.users_path
    if path.exists():
        return Users.load(path)
    users = Users()
    password = os.environ.get("CHANGEFEED_PASSWORD")
    if password is None:
        password = "password"
        log.warning("created %s with user %s / password 'password'", path, DEFAULT_USER)
    users.add(DEFAULT_USER, password)
    users.save(path)
    return users


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        config.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.users = load_or_create_users(config)
        except UsersError:
            raise
        self.bucket = Bucket.open(config)
        self.connections: set[ClientConnection] = set()
        self.port = config.port
        self._server: asyncio.Server | None = None
        self._metrics: asyncio.Server | None = None
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.bucket.start()
        self._server = await loop.create_server(
            lambda: ClientConnection(self), self.config.host, self.config.port
        )
        self.port = self._server.sockets[0].getsockname()[1]
        if self.config.metrics_port:
            self._metrics = await serve_metrics(self, self.config.host, self.config.metrics_port)
        log.info(
            "serving bucket %r (%d vbuckets) on %s:%d, data in %s",
            self.bucket.name,
            self.config.vbuckets,
            self.config.host,
            self.port,
            self.config.data_dir,
        )

    async def run(self, *, ready_file: str | None = None) -> None:
        """Serve until SIGTERM/SIGINT; then shut down cleanly."""
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopped.set)
        if ready_file:
            with open(ready_file, "w") as handle:
                handle.write(str(self.port))
        await self._stopped.wait()
        await self.stop()

    def request_stop(self) -> None:
        self._stopped.set()

    async def stop(self) -> None:
        log.info("shutting down: flushing and closing the store")
        if self._server is not None:
            self._server.close()
        if self._metrics is not None:
            self._metrics.close()
        for conn in list(self.connections):
            conn.close()
        await asyncio.sleep(0)
        await self.bucket.close()

    def kick_dcp_name(self, name: str) -> None:
        """A DCP name reused by a new connection kicks the old one (dcp-wire.md §4)."""
        for conn in list(self.connections):
            if conn.dcp is not None and conn.dcp.name == name:
                log.info("DCP name %r reused: closing the older connection", name)
                conn.close()

    def stats(self, group: str) -> Iterator[tuple[str, str]]:
        """STAT groups: "" (general), "vbucket-seqno [vb]", "failovers [vb]", "dcp"."""
        parts = group.split()
        name = parts[0] if parts else ""
        vbs = [int(parts[1])] if len(parts) > 1 and parts[1].isdigit() else None
        if name == "":
            yield "curr_connections", str(len(self.connections))
            yield "curr_items", str(self.bucket.item_count())
            yield "vb_active_num", str(len(self.bucket.vbucket_ids()))
            yield "checkpoint_memory_bytes", str(self.bucket.checkpoint_memory_bytes())
        elif name == "vbucket-seqno":
            yield from self.bucket.seqno_stats(vbs)
        elif name == "failovers":
            yield from self.bucket.failover_stats(vbs)
        elif name == "dcp":
            for conn in self.connections:
                if conn.dcp is None:
                    continue
                p = conn.dcp.producer
                yield f"{p.name}:streams", str(len(p.streams))
                yield f"{p.name}:unacked_bytes", str(p.flow.outstanding_bytes)
                yield f"{p.name}:acked_bytes", str(p.flow.acked_bytes_total)

    def cluster_config(self) -> dict[str, object]:
        """A Couchbase-style cluster map for this single node (every vbucket active here)."""
        server = f"{self.config.host}:{self.port}"
        return {
            "rev": 1,
            "name": self.bucket.name,
            "nodeLocator": "vbucket",
            "nodes": [{"hostname": f"{self.config.host}:8091", "ports": {"direct": self.port}}],
            "nodesExt": [{"hostname": self.config.host, "services": {"kv": self.port}}],
            "vBucketServerMap": {
                "hashAlgorithm": "CRC",
                "numReplicas": 0,
                "serverList": [server],
                "vBucketMap": [[0] for _ in range(self.config.vbuckets)],
            },
        }
