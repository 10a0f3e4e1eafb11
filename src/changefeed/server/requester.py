"""What a command handler may use of the connection a request came on.

Handlers outside connection.py (kv_commands.py, subdoc.py) take a `Requester`, not the
`ClientConnection` itself, so the handler modules need not import the connection that imports
them (no cycle); `ClientConnection` satisfies it structurally.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, TypeVar

from changefeed.protocol.frame import Frame
from changefeed.protocol.status import Status
from changefeed.server.authenticator import SaslAuthenticator
from changefeed.server.context import ServerContext
from changefeed.server.settled_answers import SettledAnswers

T = TypeVar("T")


class Requester(Protocol):
    """The connection side of a request, as handlers see it."""

    context: ServerContext
    features: set[int]
    bucket_selected: bool
    map_version_seen: tuple[int, int]  # newest cluster map (epoch, rev) fetched or pushed
    peer: str
    sasl: SaslAuthenticator
    settled_answers: SettledAnswers  # durable writes' outcomes, answered in settle order

    def reply(
        self,
        request: Frame,
        status: int = Status.SUCCESS,
        *,
        extras: bytes = b"",
        key: bytes = b"",
        value: bytes = b"",
        cas: int = 0,
        datatype: int = 0,
    ) -> None:
        """Answer `request` (collected and written once per received batch)."""
        ...

    def require_bucket(self) -> None:
        """Raise NoBucketError unless a bucket was selected."""
        ...

    def send(self, data: bytes) -> None:
        """Write an unsolicited frame (a server push)."""
        ...

    def answers_expected(self, count: int) -> None:
        """`count` requests are answered later, through `settled_answers`."""
        ...

    def answer_when_done(
        self, request: Frame, outcome: asyncio.Future[T], answer: Callable[[T], None]
    ) -> None:
        """Answer `request` with `answer(result)` once `outcome` is done (or its error)."""
        ...
