"""DCP consumer library and SDK-style KV client (asyncio).

``DcpClient`` streams vbuckets, each from the node the cluster map names active, with
rollback handling, flow control and noops; ``SessionState`` is the JSON resume point;
``KvClient`` writes and reads keys and answers each write with the
``MutationResult`` the node built (one class on both sides of the wire, protocol/kv.py).
"""

from changefeed.consumer.current_state import Document, HistoryChangedError, read_current_state
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
from changefeed.consumer.kv_client import GetResult, KvClient
from changefeed.consumer.session import SessionState, VbSession
from changefeed.protocol.kv import MutationResult

__all__ = [
    "Changes",
    "ClientConfig",
    "DcpClient",
    "Disconnected",
    "Document",
    "Event",
    "GetResult",
    "HistoryChangedError",
    "KvClient",
    "MutationResult",
    "Rollback",
    "SessionState",
    "Snapshot",
    "StreamEnded",
    "StreamOpened",
    "StreamRefused",
    "VbSession",
    "read_current_state",
]
