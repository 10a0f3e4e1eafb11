"""The current state of vbuckets, read over DCP: each key's newest version with all its metadata.

A stream of a vbucket from seqno 0 to its high seqno at request time (``TO_LATEST``) brings every
key the vbucket holds, live documents and the tombstones not yet purged, each at least once: a
disk backfill is deduplicated, the memory part may repeat a key, and the highest seqno wins.
Each ``Document`` carries what the item carried: seqno, CAS, flags, expiry, rev_seqno, datatype
and whether it is a deletion. That is what a GET cannot tell (it answers value, flags, CAS and
datatype, no seqno, expiry or rev_seqno), and the node has no GET_META. A key the read does not
return is not in the vbucket (never written, or its tombstone purged): callers treat it as
deleted.

Users: the Spark mirror re-reads the keys a rollback voided (spark/mirror.py), and
``changefeed demo`` reads its truth. Cost: a full backfill of every vbucket named, O(items of
the vbucket) on the wire; memory: only the documents of the keys asked for (all with
``keys=None``).

A rollback while reading (the node changed history under us, e.g. a failover during a
reconnect) voids what was read of that vbucket: it is read again from seqno 0, at most
``READ_ATTEMPTS_MAX`` times. Not here: which keys to ask for, and how a sink narrows the wire's
unsigned values (``change_rows.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Collection
from dataclasses import dataclass

from changefeed.consumer.dcp_client import ClientConfig, DcpClient
from changefeed.consumer.events import Changes, Rollback, StreamEnded, StreamRefused
from changefeed.protocol.dcp import StreamEndReason
from changefeed.protocol.errors import error_for_status
from changefeed.protocol.opcode import Opcode

READ_ATTEMPTS_MAX = 3  # reads of one vbucket; each further one follows a history change
READ_TIMEOUT_S = 300.0  # one whole read: a full backfill of every vbucket named
_DELETIONS = (int(Opcode.DCP_DELETION), int(Opcode.DCP_EXPIRATION))


class HistoryChangedError(RuntimeError):
    """A vbucket rolled back (or its stream ended early) on every attempt to read it."""


@dataclass(frozen=True, slots=True)
class Document:
    """A key's newest version in its vbucket, as the stream sent it (unsigned wire values)."""

    vbucket: int
    key: bytes
    seqno: int
    deleted: bool  # a deletion or expiration tombstone; value b"", flags and expiry 0
    value: bytes
    cas: int  # u64
    flags: int  # u32
    expiry: int  # u32, absolute seconds; 0 = never
    rev_seqno: int
    datatype: int


async def read_current_state(
    config: ClientConfig,
    vbuckets: Collection[int],
    keys: Collection[bytes] | None = None,
    *,
    timeout_s: float = READ_TIMEOUT_S,
) -> dict[bytes, Document]:
    """Read the newest version of every key (or only of ``keys``) in ``vbuckets``.

    Args:
        config: the node and credentials; its stream settings are replaced (from seqno 0 to
            the latest seqno, a fresh connection name).
        vbuckets: the vbuckets to read, each in full.
        keys: the keys wanted (others are skipped as they arrive); ``None`` for all.
        timeout_s: deadline of the whole read.

    Returns:
        key -> its newest ``Document``, tombstones included; keys absent from the vbuckets are
        absent here.

    Raises:
        StatusError: the node refused a stream (e.g. NOT_MY_VBUCKET); the class says which.
        HistoryChangedError: a vbucket rolled back on every one of ``READ_ATTEMPTS_MAX`` reads.
        TimeoutError: the read took longer than ``timeout_s``.
    """
    wanted = None if keys is None else frozenset(keys)
    pending = sorted(set(vbuckets))
    found: dict[bytes, Document] = {}
    async with asyncio.timeout(timeout_s):
        for _ in range(READ_ATTEMPTS_MAX):
            if not pending:
                break
            pending = await _read_once(config, pending, wanted, found)
    if pending:
        raise HistoryChangedError(
            f"vbuckets {pending} changed history on each of {READ_ATTEMPTS_MAX} reads"
        )
    assert wanted is None or found.keys() <= wanted, "a key nobody asked for"
    assert all(doc.vbucket in vbuckets for doc in found.values()), "a vbucket nobody asked for"
    return found


async def _read_once(
    config: ClientConfig,
    vbuckets: list[int],
    wanted: frozenset[bytes] | None,
    found: dict[bytes, Document],
) -> list[int]:
    """Read ``vbuckets`` from seqno 0 into ``found``; returns those to read again."""
    config = dataclasses.replace(
        config,
        name=f"changefeed:current-state:{uuid.uuid4().hex}",  # a reused name kicks the older
        to_latest=True,
    )
    unfinished = set(vbuckets)
    redo: set[int] = set()
    last_seqno = dict.fromkeys(vbuckets, 0)
    async with DcpClient(config) as client:
        await client.stream(vbuckets, start="beginning")
        async for event in client.events():  # ends when every stream ended
            if isinstance(event, Changes):
                _take(event, wanted, found, redo, last_seqno)
            elif isinstance(event, Rollback):
                redo.add(event.vbucket)  # what we read of it may be void: read it again
            elif isinstance(event, StreamEnded):
                unfinished.discard(event.vbucket)
                if event.reason != StreamEndReason.OK:
                    redo.add(event.vbucket)
            elif isinstance(event, StreamRefused):
                raise error_for_status(event.status, f"vbucket {event.vbucket}: {event.message}")
            if not unfinished:
                break
    for key in [k for k, doc in found.items() if doc.vbucket in redo]:
        del found[key]
    return sorted(redo)


def _take(
    event: Changes,
    wanted: frozenset[bytes] | None,
    found: dict[bytes, Document],
    redo: set[int],
    last_seqno: dict[int, int],
) -> None:
    cols = event.columns
    for i in range(len(cols)):
        vb, seqno, key = cols.vbucket[i], cols.seqno[i], cols.key[i]
        if vb in redo:
            continue  # read again from seqno 0 on the next attempt
        assert seqno > last_seqno[vb], f"vb {vb}: seqno {seqno} after {last_seqno[vb]}"
        last_seqno[vb] = seqno
        if wanted is not None and key not in wanted:
            continue
        held = found.get(key)
        assert held is None or held.seqno < seqno, (key, held, seqno)  # a key has one vbucket
        found[key] = Document(
            vb, key, seqno, cols.opcode[i] in _DELETIONS, cols.value[i], cols.cas[i],
            cols.flags[i], cols.expiry[i], cols.rev_seqno[i], cols.datatype[i],
        )  # fmt: skip
