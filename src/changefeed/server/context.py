"""What every connection of a node shares, handed to it at construction.

The node builds one `ServerContext`; connections, stats and metrics read it. Nothing below the
node reaches up to the node itself, so the server's modules import each other in one direction
(context ← connection ← node).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.registry import DcpRegistry
from changefeed.server.users import Users


class Closable(Protocol):
    """A live connection as the node sees it: it can be closed at shutdown."""

    def close(self) -> None: ...


@dataclasses.dataclass(slots=True)
class ServerContext:
    """The node's shared state.

    Attributes:
        config: the node's configuration.
        users: who may authenticate.
        bucket: the one bucket this node serves.
        dcp: live DCP connections by name.
        connections: every open client connection (stats, shutdown).
        monotonic: seconds for timeouts and noops; injected so tests replay.
        port: the bound KV port (known once listening; config.port may be 0).
    """

    config: NodeConfig
    users: Users
    bucket: Bucket
    dcp: DcpRegistry = dataclasses.field(default_factory=DcpRegistry)
    connections: set[Closable] = dataclasses.field(default_factory=set)
    monotonic: Callable[[], float] = time.monotonic
    port: int = 0
