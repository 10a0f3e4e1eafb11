"""Pipelined writes of a generated workload, each key's writes landing in the order made.

`changefeed load` and the demo generate a stream of sets, expiring sets and deletes. Sent one
at a time each costs a round trip (~7k ops/s on one node); sent as `KvClient.upsert_many`
windows they go at the node's pace. The order of two writes of one key must not change, so
the stream is cut into segments: a segment holds plain sets in order (a key may repeat: one
connection per node applies them in order), then deletes and expiring sets, at most one per
key, sent together once the sets are answered. A write of a key that already has a delete or
an expiring set in the segment flushes the segment first, as does a full segment. A flushed
segment is sent while the next one is made; it starts once the one before is wholly answered,
so no write passes an earlier one.

Not here: what the workload is (cli/client_commands.py, cli/demo.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from changefeed.consumer.kv_client import PIPELINE_DEPTH_MAX, Durability, KvClient
from changefeed.protocol.errors import KeyNotFoundError
from changefeed.protocol.kv import MutationResult

SEGMENT_MAX = 2 * PIPELINE_DEPTH_MAX  # two windows: upsert_many keeps both in flight


@dataclass(frozen=True, slots=True)
class _Other:
    """A delete (`expiry` None) or an expiring set, sent after the segment's plain sets."""

    key: bytes
    value: bytes = b""
    expiry: int | None = None


@dataclass
class OrderedWrites:
    """Buffers a workload's writes into segments (see the module docstring).

    Args:
        kv: the client the writes go through.
        durability: "persist" waits until every write of a segment is persisted when it is
            flushed; "none" does not wait.
        missing_ok: a delete that finds no key is counted in `missing` instead of raising.
        segment_max: writes a segment holds before it is flushed.

    Attributes:
        sets, deletes, missing: writes flushed so far (`missing`: deletes that found no key).
    """

    kv: KvClient
    durability: Durability = "none"
    missing_ok: bool = False
    segment_max: int = SEGMENT_MAX
    sets: int = 0
    deletes: int = 0
    missing: int = 0
    _plain: list[tuple[bytes, bytes]] = field(default_factory=list)
    _others: dict[bytes, _Other] = field(default_factory=dict)
    _sending: asyncio.Task[None] | None = None  # the segment flushed last, while it is sent

    @property
    def pending(self) -> int:
        """Writes buffered and not flushed yet."""
        return len(self._plain) + len(self._others)

    async def set(self, key: bytes, value: bytes, *, expiry: int = 0) -> None:
        """Write `value` at `key` (with `expiry`, as memcached takes it: 0 never expires)."""
        if key in self._others:
            await self.flush()  # it would go before the delete or expiring set sent after
        if expiry:
            self._others[key] = _Other(key, value, expiry)
        else:
            self._plain.append((key, value))
        if self.pending >= self.segment_max:
            await self.flush()

    async def delete(self, key: bytes) -> None:
        """Delete `key` (raises KeyNotFoundError at the flush unless `missing_ok`)."""
        if key in self._others:
            await self.flush()  # the two would go at once, in either order
        self._others[key] = _Other(key)
        if self.pending >= self.segment_max:
            await self.flush()

    async def flush(self) -> None:
        """Start sending what is buffered, once the segment before is answered: the plain
        sets as pipelined windows, then the deletes and expiring sets all at once. Returns
        while it is sent (`drain` waits for it); a failed segment raises here or in `drain`."""
        await self._wait_sent()
        plain, others = self._plain, list(self._others.values())
        self._plain, self._others = [], {}
        if plain or others:
            self._sending = asyncio.ensure_future(self._send_segment(plain, others))

    async def drain(self) -> None:
        """Flush, and wait until every write is answered (and persisted, with "persist")."""
        await self.flush()
        await self._wait_sent()

    async def aclose(self) -> None:
        """Stop a segment still being sent (after a failure elsewhere): nothing is left running."""
        sending, self._sending = self._sending, None
        if sending is not None and not sending.done():
            sending.cancel()
            with contextlib.suppress(BaseException):
                await sending

    async def _wait_sent(self) -> None:
        sending, self._sending = self._sending, None
        if sending is not None:
            await sending

    async def _send_segment(self, plain: list[tuple[bytes, bytes]], others: list[_Other]) -> None:
        if plain:
            await self.kv.upsert_many(plain, durability=self.durability)
            self.sets += len(plain)
        if not others:
            return
        written = await asyncio.gather(*(self._send(other) for other in others))
        done = [result for result in written if result is not None]
        if self.durability == "persist" and done:
            await self.kv.wait_all_persisted(done)

    async def _send(self, other: _Other) -> MutationResult | None:
        if other.expiry is not None:
            self.sets += 1
            return await self.kv.upsert(other.key, other.value, expiry=other.expiry)
        try:
            result = await self.kv.remove(other.key)
        except KeyNotFoundError:
            if not self.missing_ok:
                raise
            self.missing += 1
            return None
        self.deletes += 1
        return result
