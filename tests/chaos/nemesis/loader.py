"""The chaos loader: workers upserting keys through ``KvClient`` (which follows the map
through failovers) at a configurable durability level, recording every write's outcome.

Each worker owns its keys and writes one at a time, versions 1, 2, 3... per key, so a key's
writes are ordered in real time and its final value names the write that won
(``history.value_for``). Outcomes are classified as a Jepsen client would:

* ``OK``: the node answered success (durable when a SyncWrite level was asked for);
* ``FAILED``: a status meaning "not done" (``DEFINITE``: DURABILITY_IMPOSSIBLE, TMPFAIL,
  NOT_MY_VBUCKET...) — but only if the client sent the request once: ``KvClient`` retries a
  lost connection on its own, so a definite answer after a retry may follow an attempt that
  did take effect, and is ambiguous;
* ``AMBIGUOUS``: SYNC_WRITE_AMBIGUOUS, a timeout, a lost connection, any other status.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from changefeed.consumer import KvClient
from changefeed.consumer.connection import ConnectionClosedError
from changefeed.consumer.kv_client import Durability
from changefeed.protocol.errors import StatusError
from changefeed.protocol.status import Status

from .history import Outcome, WriteRecord, value_for

# Statuses that say the write was not applied.
DEFINITE = frozenset(
    {
        Status.DURABILITY_IMPOSSIBLE,
        Status.DURABILITY_INVALID_LEVEL,
        Status.SYNC_WRITE_IN_PROGRESS,
        Status.ETMPFAIL,
        Status.NOT_MY_VBUCKET,
        Status.ENOMEM,
        Status.EBUSY,
        Status.E2BIG,
        Status.EINVAL,
    }
)
# The SyncWrite levels: acknowledged only once a majority of the vbucket's copies hold the
# write, so it must survive the loss of any minority ("persist" waits for the active's disk
# only, and a failover may still lose it).
DURABLE_LEVELS = frozenset({"majority", "majorityAndPersistActive", "persistToMajority"})
WRITE_TIMEOUT_S = 45.0  # above KvClient's own bounds (30 s per request, 15 s of rerouting)
CONNECT_TIMEOUT_S = 10.0
PADDING = 64  # bytes of filler per value


@dataclass
class LoaderStats:
    connects: int = 0
    connect_failures: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)  # the first message of each error
    last: dict[str, str] = field(default_factory=dict)  # and the last


class Loader:
    """``workers`` writers, each connecting to any of ``seeds`` (``(host, port)``) that answers.

    A write goes, with probability ``fresh``, to a key never written before (written once:
    its loss is always visible at the end), else updates one of ``keys`` hot keys (key i
    belongs to worker i % workers; updates exercise rev_seqno, deduplication and stale
    values, but a lost update is visible only when it was the key's last)."""

    def __init__(
        self,
        seeds: Sequence[tuple[str, int]],
        *,
        durability: Durability,
        rng: random.Random,
        clock: float,
        workers: int = 4,
        keys: int = 400,
        fresh: float = 0.5,
        pause_s: float = 0.0,
    ) -> None:
        self.seeds = list(seeds)
        self.durability: Durability = durability
        self.durable = durability in DURABLE_LEVELS
        self.rng = rng
        self.clock = clock
        self.workers = workers
        self.keys = [b"chaos-%05d" % i for i in range(keys)]
        self.fresh = fresh
        self.pause_s = pause_s
        self.writes: list[WriteRecord] = []
        self.stats = LoaderStats()
        self._versions: dict[bytes, int] = {}
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Write until ``stop``; each worker's in-flight write is finished and recorded."""
        seeds = [random.Random(self.rng.random()) for _ in range(self.workers)]
        await asyncio.gather(*(self._worker(i, seeds[i]) for i in range(self.workers)))

    def _now(self) -> float:
        return time.monotonic() - self.clock

    async def _connect(self, rng: random.Random) -> KvClient | None:
        for host, port in rng.sample(self.seeds, len(self.seeds)):
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    client = await KvClient.connect(host, port)
                self.stats.connects += 1
                return client
            except (OSError, TimeoutError, ConnectionClosedError, StatusError):
                self.stats.connect_failures += 1
        return None

    async def _worker(self, index: int, rng: random.Random) -> None:
        mine = self.keys[index :: self.workers]
        fresh = 0
        kv: KvClient | None = None
        try:
            while not self._stop.is_set():
                if kv is None:
                    kv = await self._connect(rng)
                    if kv is None:
                        await asyncio.sleep(0.5)
                        continue
                if not mine or rng.random() < self.fresh:
                    key = b"chaos-u%02d-%07d" % (index, fresh)
                    fresh += 1
                else:
                    key = rng.choice(mine)
                await self._write_one(kv, key)
                if self.pause_s:
                    await asyncio.sleep(self.pause_s)
        finally:
            if kv is not None:
                await kv.close()

    async def _write_one(self, kv: KvClient, key: bytes) -> None:
        version = self._versions.get(key, 0) + 1
        self._versions[key] = version
        value = value_for(key, version, PADDING)
        retries_before = kv.retries + kv.reconnects
        started = self._now()
        outcome, error, message = Outcome.OK, "", ""
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await kv.upsert(key, value, durability=self.durability)
        except StatusError as failure:
            error, message = type(failure).__name__, str(failure)
            resent = kv.retries + kv.reconnects != retries_before
            definite = failure.code in DEFINITE and not resent
            outcome = Outcome.FAILED if definite else Outcome.AMBIGUOUS
        except (OSError, TimeoutError, ConnectionClosedError) as failure:
            error, message = type(failure).__name__, str(failure)
            outcome = Outcome.AMBIGUOUS
        if error:
            self.stats.errors[error] = self.stats.errors.get(error, 0) + 1
            self.stats.examples.setdefault(error, f"{message[:200]} at {started:.1f}s")
            self.stats.last[error] = f"{message[:200]} at {started:.1f}s"
        self.writes.append(
            WriteRecord(key, version, outcome, self.durable, error, started, self._now())
        )
