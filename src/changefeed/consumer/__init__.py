"""DCP consumer library and SDK-style KV client (asyncio).

``DcpClient`` streams vbuckets with rollback handling, flow control and noops; ``SessionState``
is the JSON resume point; ``KvClient`` writes and reads keys. ``sync`` has blocking facades.
"""

from changefeed.consumer.dcp_client import ClientConfig, DcpClient
from changefeed.consumer.events import (
    Changes,
    Disconnected,
    Event,
    Rollback,
    Snapshot,
    StreamEnded,
    StreamOpened,
    StreamRefused,
)
from changefeed.consumer.kv_client import GetResult, KvClient, MutationResult
from changefeed.consumer.session import SessionState, VbSession

__all__ = [
    "Changes",
    "ClientConfig",
    "DcpClient",
    "Disconnected",
    "Event",
    "GetResult",
    "KvClient",
    "MutationResult",
    "Rollback",
    "SessionState",
    "Snapshot",
    "StreamEnded",
    "StreamOpened",
    "StreamRefused",
    "VbSession",
]
