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

from changefeed.producer.backfill_slots import BackfillSlots
from changefeed.server.authenticator import AuthThrottle
from changefeed.server.bucket import Bucket
from changefeed.server.budget import PartialBytesBudget
from changefeed.server.compactor import Compactor
from changefeed.server.config import NodeConfig
from changefeed.server.expiry_pager import ExpiryPager
from changefeed.server.registry import DcpRegistry
from changefeed.server.users import Users


class Closable(Protocol):
    """A live connection as the node sees it: closed at shutdown, checked for deadlines."""

    def close(self) -> None: ...

    def check_deadlines(self, now: float) -> None:
        """Close the connection if it overstayed a deadline (auth, idle, partial request)."""
        ...


@dataclasses.dataclass(slots=True)
class ServerContext:
    """The node's shared state.

    Attributes:
        config: the node's configuration.
        users: who may authenticate.
        bucket: the one bucket this node serves.
        dcp: live DCP connections by name.
        connections: every open client connection (stats, shutdown, deadlines).
        partial: the node-wide bound on bytes of unfinished requests.
        backfill_slots: the node-wide bound on disk backfills running at once.
        compactor, expiry_pager: the node's background workers (None until the node makes
            them): COMPACT_DB, STAT and /metrics reach them here.
        node_secret: derives stable decoy SCRAM salts for unknown users (users.py).
        auth_throttle: per-host failed-authentication budget, shared by all connections.
        monotonic: seconds for timeouts and noops; injected so tests replay.
        port: the bound KV port (known once listening; config.port may be 0).
    """

    config: NodeConfig
    users: Users
    bucket: Bucket
    dcp: DcpRegistry = dataclasses.field(default_factory=DcpRegistry)
    connections: set[Closable] = dataclasses.field(default_factory=set)
    partial: PartialBytesBudget = dataclasses.field(default_factory=PartialBytesBudget)
    backfill_slots: BackfillSlots = dataclasses.field(default_factory=BackfillSlots)
    compactor: Compactor | None = None
    expiry_pager: ExpiryPager | None = None
    node_secret: bytes | None = None
    auth_throttle: AuthThrottle = dataclasses.field(default_factory=AuthThrottle)
    monotonic: Callable[[], float] = time.monotonic
    port: int = 0
