"""The sans-IO parts of a ``DcpClient`` that follows the cluster map.

* ``apply_event`` moves a session by one event (what the application has taken);
* ``positions`` says where each vbucket's stream really is: the application's session plus the
  events still queued for it. A stream moved to another node (its node stopped being active,
  refused it, or dropped) is requested again from there, so nothing is skipped or repeated;
* ``Retries`` keeps the bounded, backed-off re-placement attempts of each vbucket;
* ``read_cluster_config`` reads GET_CLUSTER_CONFIG's body and which node answered it.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

import numpy as np

from changefeed.consumer.events import (
    Changes,
    CollectionEvent,
    Event,
    Rollback,
    SeqnoAdvanced,
    Snapshot,
    StreamOpened,
)
from changefeed.consumer.session import SessionState, VbSession
from changefeed.failover import FailoverLog
from changefeed.vbmap import ClusterMap


def apply_event(state: SessionState, event: Event) -> None:
    """Advance ``state`` by ``event`` (data, markers, rollbacks and new failover logs)."""
    if isinstance(event, Changes):
        # Per run and vbucket, not per item: the columns' arrays (session.py).
        cols = event.columns
        state.on_items(cols.array("vbucket"), cols.array("seqno"))
    elif isinstance(event, Snapshot):
        session = state.get(event.vbucket)
        session.on_marker(event.snap_start, event.snap_end)
        session.purge_seqno = max(session.purge_seqno, event.purge_seqno)
    elif isinstance(event, Rollback):
        state.get(event.vbucket).rollback_to(event.seqno)
    elif isinstance(event, StreamOpened):
        state.get(event.vbucket).failover_log = FailoverLog(event.failover_log)
    elif isinstance(event, CollectionEvent):
        message = event.message
        state.get(event.vbucket).on_system_event(message.seqno, message.manifest_uid)
    elif isinstance(event, SeqnoAdvanced):
        state.get(event.vbucket).on_seqno_advanced(event.seqno)


def positions(
    session: SessionState, queued: Iterable[Event], vbuckets: Collection[int]
) -> dict[int, VbSession]:
    """Where the streams of ``vbuckets`` are once the ``queued`` events are taken: copies of
    ``session``'s entries advanced by those events (``session`` itself is not changed).

    One pass over the queue for all of ``vbuckets`` (a dropped node moves many at once)."""
    state = SessionState()
    for vb in vbuckets:
        found = session.vbuckets.get(vb)
        state.vbuckets[vb] = found.copy() if found is not None else VbSession(vb)
    wanted = np.fromiter(vbuckets, dtype=np.int64, count=len(vbuckets))
    for event in queued:
        if isinstance(event, Changes):
            cols = event.columns
            vbs = cols.array("vbucket")
            mine = np.isin(vbs, wanted)
            if mine.any():
                state.on_items(vbs[mine], cols.array("seqno")[mine])
        elif (
            isinstance(event, Snapshot | Rollback | StreamOpened | CollectionEvent | SeqnoAdvanced)
            and event.vbucket in state.vbuckets
        ):
            apply_event(state, event)
    return state.vbuckets


class RetryKind(Enum):
    """Why a vbucket must be placed again; each kind has its own budget of attempts."""

    MOVED = "moved"  # NOT_MY_VBUCKET, or STREAM_END(STATE_CHANGED): the map points elsewhere
    UNREACHABLE = "unreachable"  # its node's connection dropped or could not be opened
    MANIFEST_BEHIND = "manifest_behind"  # COLLECTIONS_MANIFEST_IS_AHEAD: the node catches up


@dataclass(slots=True)
class _Due:
    at: float
    refresh: bool  # read the map again before placing


class Retries:
    """Per vbucket: the attempts made of each kind and when the next one is due.

    Attempt n waits ``backoff_s[n - 1]`` (the last entry repeats) times a jitter in
    [0.5, 1.5), drawn once per ``schedule`` call so that the vbuckets of one node move
    together (one connection attempt, not one per vbucket). A vbucket's counts reset when its
    stream opens.
    """

    def __init__(
        self,
        backoff_s: tuple[float, ...],
        budget: Mapping[RetryKind, int],
        rng: random.Random,
    ) -> None:
        assert backoff_s, "a backoff schedule needs an entry"
        self._backoff_s = backoff_s
        self._budget = dict(budget)
        self._rng = rng
        self._attempts: dict[tuple[int, RetryKind], int] = {}
        self._due: dict[int, _Due] = {}

    def schedule(
        self, vbuckets: Iterable[int], kind: RetryKind, now: float, *, immediate: bool = False
    ) -> list[int]:
        """Plan another attempt for each of ``vbuckets``: at once when ``immediate`` (a newer
        map is known already), else after the backoff and a map refresh.

        Returns:
            the vbuckets whose budget of ``kind`` is spent (forgotten here).
        """
        jitter = 0.5 + self._rng.random()
        spent = []
        for vb in vbuckets:
            attempt = self._attempts.get((vb, kind), 0) + 1
            if attempt > self._budget[kind]:
                self.forget(vb)
                spent.append(vb)
                continue
            self._attempts[vb, kind] = attempt
            delay = 0.0 if immediate else self._backoff_s[
                min(attempt, len(self._backoff_s)) - 1
            ] * jitter  # fmt: skip
            self._due[vb] = _Due(now + delay, refresh=not immediate)
        return spent

    def take_due(self, now: float) -> tuple[list[int], bool]:
        """Remove and return the vbuckets due by ``now`` (ascending), and whether any of them
        wants the map read again first."""
        due = sorted(vb for vb, d in self._due.items() if d.at <= now)
        taken = [self._due.pop(vb) for vb in due]
        return due, any(d.refresh for d in taken)

    def next_delay(self, now: float) -> float | None:
        """Seconds until the next attempt is due (0 if one is), None when none is planned."""
        if not self._due:
            return None
        return max(0.0, min(d.at for d in self._due.values()) - now)

    def succeeded(self, vb: int) -> None:
        for kind in RetryKind:
            self._attempts.pop((vb, kind), None)

    def forget(self, vb: int) -> None:
        self.succeeded(vb)
        self._due.pop(vb, None)

    def pending(self) -> set[int]:
        return set(self._due)

    def hurry(self, vbuckets: Iterable[int], now: float) -> None:
        """Make the planned attempts of ``vbuckets`` due at once, without another map read (a
        newer map was just read: it may place them on a live node)."""
        for vb in vbuckets:
            if vb in self._due:
                self._due[vb] = _Due(now, refresh=False)


def read_cluster_config(config: object, fallback_server: str) -> tuple[ClusterMap, str]:
    """The map in a GET_CLUSTER_CONFIG body and the ``host:port`` of the node that sent it
    (its ``nodesExt`` entry says ``thisNode``; else ``fallback_server``, the address dialled).

    Raises:
        ValueError: not a usable config (names what is wrong).
    """
    cluster_map = ClusterMap.from_couchbase_config(config)
    assert isinstance(config, dict)  # from_couchbase_config checked it
    nodes_ext = config.get("nodesExt")
    if isinstance(nodes_ext, list):
        for index, entry in enumerate(nodes_ext):
            if isinstance(entry, dict) and entry.get("thisNode") and index < len(cluster_map.nodes):
                return cluster_map, cluster_map.nodes[index].server
    return cluster_map, fallback_server
