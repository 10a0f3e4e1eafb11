"""A checking consumer and the truth readers.

``StreamedState`` is what a careful consumer application keeps of a DCP stream: every change per
vbucket in seqno order, so that a ``Rollback`` can discard the changes after its seqno and the
state before them comes back. It asserts invariant 3 (seqnos only rise within a vbucket, except
after a rollback) on every item. (Not to be confused with ``changefeed.spark.mirror``, the Delta
mirror table: this one is in memory and keeps history.) ``drain`` runs a ``DcpClient`` into a
``StreamedState`` until a condition holds, with a deadline. ``server_state`` is the truth: what
a fresh client streaming every vbucket from the beginning to the latest seqno receives. Each
``Change`` keeps the whole item (seqno, CAS, flags, expiry, rev_seqno, datatype, deleted), so
a check can compare metadata and not only values (``latest()``); ``live()`` and ``values()``
are the value-only views older checks use.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from changefeed.cli.node_process import NodeProcess
from changefeed.consumer import (
    Changes,
    DcpClient,
    Disconnected,
    Event,
    Rollback,
    SessionState,
    Snapshot,
    StreamEnded,
    StreamOpened,
    StreamRefused,
)
from changefeed.consumer.dcp_client import Start
from changefeed.protocol.opcode import Opcode

from .clients import dcp_config

OP_DELETION = Opcode.DCP_DELETION
OP_EXPIRATION = Opcode.DCP_EXPIRATION
MARKER_MEMORY = 0x01
MARKER_DISK = 0x02
TRUTH_TIMEOUT_S = 60.0


@dataclass(slots=True)
class Change:
    """One item as the stream sent it: the document and all its metadata (the wire's unsigned
    values, unchanged). ``value`` is ``b""`` and ``flags``/``expiry`` are 0 for tombstones."""

    seqno: int
    key: bytes
    deleted: bool
    value: bytes
    vbucket: int = 0
    cas: int = 0
    flags: int = 0
    expiry: int = 0
    rev_seqno: int = 0
    datatype: int = 0


@dataclass
class StreamedState:
    """Everything a consumer received, per vbucket, with rollbacks applied."""

    history: dict[int, list[Change]] = field(default_factory=dict)
    last_seqno: dict[int, int] = field(default_factory=dict)
    markers: list[tuple[int, int, int, int]] = field(default_factory=list)  # vb, start, end, flags
    rollbacks: list[tuple[int, int]] = field(default_factory=list)
    ended: dict[int, int] = field(default_factory=dict)  # vb -> StreamEndReason
    refused: list[StreamRefused] = field(default_factory=list)
    opened: set[int] = field(default_factory=set)
    disconnects: int = 0
    items: int = 0
    received: dict[int, list[int]] = field(default_factory=dict)  # every seqno, in order
    # Per vb, in arrival order: ("item", seqno) and ("rollback", seqno).
    timeline: dict[int, list[tuple[str, int]]] = field(default_factory=dict)

    def apply(self, event: Event) -> None:
        if isinstance(event, Changes):
            cols = event.columns
            for i in range(len(cols)):
                vb, seqno = cols.vbucket[i], cols.seqno[i]
                last = self.last_seqno.get(vb, 0)
                assert seqno > last, f"vb {vb}: seqno {seqno} after {last} without a rollback"
                self.last_seqno[vb] = seqno
                deleted = cols.opcode[i] in (OP_DELETION, OP_EXPIRATION)
                change = Change(
                    seqno, cols.key[i], deleted, cols.value[i], vb, cols.cas[i], cols.flags[i],
                    cols.expiry[i], cols.rev_seqno[i], cols.datatype[i],
                )  # fmt: skip
                self.history.setdefault(vb, []).append(change)
                self.received.setdefault(vb, []).append(seqno)
                self.timeline.setdefault(vb, []).append(("item", seqno))
            self.items += len(cols)
        elif isinstance(event, Snapshot):
            self.markers.append((event.vbucket, event.snap_start, event.snap_end, event.flags))
        elif isinstance(event, Rollback):
            self.rollbacks.append((event.vbucket, event.seqno))
            self.timeline.setdefault(event.vbucket, []).append(("rollback", event.seqno))
            kept = [c for c in self.history.get(event.vbucket, []) if c.seqno <= event.seqno]
            self.history[event.vbucket] = kept
            self.last_seqno[event.vbucket] = min(self.last_seqno.get(event.vbucket, 0), event.seqno)
        elif isinstance(event, StreamEnded):
            self.ended[event.vbucket] = int(event.reason)
        elif isinstance(event, StreamOpened):
            self.opened.add(event.vbucket)
        elif isinstance(event, StreamRefused):
            self.refused.append(event)
        elif isinstance(event, Disconnected):
            self.disconnects += 1

    def latest(self) -> dict[bytes, Change]:
        """Newest change per key (deletions included), with all its metadata: the store's
        current state when ``self`` is ``server_state``'s."""
        out: dict[bytes, Change] = {}
        for changes in self.history.values():
            for change in changes:
                out[change.key] = change
        return out

    def live(self) -> dict[bytes, tuple[int, bytes]]:
        """key -> (seqno, value) of every key whose newest change is a mutation."""
        return {k: (c.seqno, c.value) for k, c in self.latest().items() if not c.deleted}

    def values(self) -> dict[bytes, bytes]:
        return {k: v for k, (_, v) in self.live().items()}


Until = Callable[[DcpClient, StreamedState], bool]


def all_ended(vbuckets: Iterable[int]) -> Until:
    wanted = set(vbuckets)
    return lambda client, state: wanted <= set(state.ended)


def reached(targets: dict[int, int]) -> Until:
    """Every vbucket's session seqno is at least its target (e.g. the server's high seqno)."""
    return lambda client, state: all(
        client.session.get(vb).seqno >= high for vb, high in targets.items()
    )


async def drain(
    client: DcpClient,
    state: StreamedState,
    until: Until,
    *,
    timeout_s: float = 60.0,
    per_event: Callable[[Event], Any] | None = None,
    stop_after_items: int | None = None,
) -> None:
    """Apply events to ``state`` until ``until`` holds (checked after each event).

    With ``stop_after_items`` it stops after the first ``Changes`` event that takes the state to
    that many items (a consumer that quits part-way, at an arbitrary point in a snapshot).
    """
    if until(client, state):
        return
    async with asyncio.timeout(timeout_s):
        async for event in client.events():
            state.apply(event)
            assert not isinstance(event, StreamRefused), event
            if per_event is not None:
                result = per_event(event)
                if asyncio.iscoroutine(result):
                    await result
            if stop_after_items is not None and state.items >= stop_after_items:
                return
            if until(client, state):
                return


async def stream_to_latest(
    node: NodeProcess,
    *,
    start: Start = "beginning",
    state: StreamedState | None = None,
    timeout_s: float = 60.0,
    **config: Any,
) -> tuple[StreamedState, SessionState]:
    """Stream every vbucket up to its high seqno at request time into ``state`` (a new one by
    default); returns the state and the session at the end."""
    state = state if state is not None else StreamedState()
    state.ended.clear()  # a state carried over from an earlier stream: wait for new ends
    vbs = list(range(node.vbuckets))
    async with DcpClient(dcp_config(node, **config)) as client:
        await client.stream(vbs, start=start)
        await drain(client, state, all_ended(vbs), timeout_s=timeout_s)
        session = SessionState.from_json(client.session.to_json())
    return state, session


async def server_state(node: NodeProcess, *, timeout_s: float = TRUTH_TIMEOUT_S) -> StreamedState:
    """The truth: what a fresh consumer streaming everything from the beginning receives.

    Raises:
        AssertionError: the stream rolled back, was refused, or broke invariant 3.
    """
    state, _ = await stream_to_latest(node, timeout_s=timeout_s)
    assert not state.rollbacks, state.rollbacks
    return state
