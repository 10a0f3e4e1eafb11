"""The chaos suite's streaming consumer: one ``DcpClient`` following the cluster map over
every vbucket for the whole run, as an application would run it.

It records what it receives (``history.ConsumerHistory``: per vbucket, items and rollbacks in
arrival order, and the state with rollbacks applied) and never asserts on the way — the
checker judges the history afterwards. The client moves streams by itself on failover
(NOT_MY_VBUCKET, STATE_CHANGED, a lost node); what it gives up on is taken up here as an
application would: a refused or ended vbucket is requested again from the session state after
a pause, and a client that fails (its nodes unreachable too long) is replaced by a new one
resuming from the old one's session (``restarts``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import Sequence

from changefeed.consumer import (
    Changes,
    ClientConfig,
    DcpClient,
    Disconnected,
    Rollback,
    SessionState,
    StreamEnded,
    StreamRefused,
)
from changefeed.protocol.errors import StatusError
from changefeed.protocol.opcode import Opcode

from .history import ConsumerHistory, Version

DELETIONS = (Opcode.DCP_DELETION, Opcode.DCP_EXPIRATION)
RESTREAM_DELAY_S = 1.0
RESTART_DELAY_S = 1.0
_names = itertools.count(1)


class ChaosConsumer:
    """Streams ``vbuckets`` from the beginning, bootstrapping from any of ``seeds``."""

    def __init__(self, seeds: Sequence[tuple[str, int]], vbuckets: int, rng: random.Random):
        self.seeds = list(seeds)
        self.vbuckets = list(range(vbuckets))
        self.rng = rng
        self.history = ConsumerHistory()
        self.session = SessionState()
        self.errors: list[str] = []
        self._client: DcpClient | None = None
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()  # re-stream requests (kept referenced)

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Consume until ``stop``, building a new client whenever one fails."""
        first = True
        while not self._stop.is_set():
            host, port = self.rng.choice(self.seeds)
            config = ClientConfig(host=host, port=port, name=f"chaos-consumer:{next(_names)}")
            try:
                async with DcpClient(config, rng=random.Random(self.rng.random())) as client:
                    self._client = client
                    await client.stream(self.vbuckets, start="beginning" if first else self.session)
                    first = False
                    await self._consume(client)
            except (OSError, TimeoutError, StatusError) as error:
                self.errors.append(f"client failed: {error!r}")
            finally:
                if self._client is not None:
                    self.session = SessionState.from_json(self._client.session.to_json())
                    self._client = None
            if not self._stop.is_set():
                self.history.restarts += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), RESTART_DELAY_S)

    async def _consume(self, client: DcpClient) -> None:
        stopping = asyncio.ensure_future(self._stop.wait())
        events = client.events().__aiter__()
        try:
            while True:  # ends on stop, or when the client fails (raised)
                taking = asyncio.ensure_future(events.__anext__())
                done, _ = await asyncio.wait(
                    {taking, stopping}, return_when=asyncio.FIRST_COMPLETED
                )
                if taking not in done:
                    taking.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await taking
                    return
                self._apply(client, taking.result())
        finally:
            stopping.cancel()

    def _apply(self, client: DcpClient, event: object) -> None:
        history = self.history
        if isinstance(event, Changes):
            cols = event.columns
            for i in range(len(cols)):
                deleted = cols.opcode[i] in DELETIONS
                version = Version(
                    cols.seqno[i], b"" if deleted else cols.value[i], cols.cas[i],
                    cols.rev_seqno[i], deleted,
                )  # fmt: skip
                history.item(cols.vbucket[i], cols.key[i], version)
        elif isinstance(event, Rollback):
            history.rollback(event.vbucket, event.seqno)
        elif isinstance(event, Disconnected):
            history.disconnects += 1
        elif isinstance(event, StreamRefused | StreamEnded):
            history.refusals += 1
            self.errors.append(f"{event}")
            task = asyncio.get_running_loop().create_task(self._restream(client, event.vbucket))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _restream(self, client: DcpClient, vb: int) -> None:
        """Request a vbucket the client gave up on again, from the session (a later stream
        request of the same client continues where the application stands)."""
        await asyncio.sleep(RESTREAM_DELAY_S)
        if self._client is client and not self._stop.is_set():
            try:
                await client.stream([vb], start=client.session)
            except (OSError, TimeoutError, StatusError) as error:
                self.errors.append(f"re-stream vb {vb}: {error!r}")
