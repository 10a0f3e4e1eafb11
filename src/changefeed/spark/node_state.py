"""What the planner asks the cluster: each vbucket's high seqno and current vb_uuid, from the
node holding its active copy.

Runs in Spark's per-query runner process (offset planning), over short-lived connections. The
cluster map comes from the first seed that answers (GET_CLUSTER_CONFIG, ``cluster.py``); each
active node then gets one connection carrying, pipelined, GET_FAILOVER_LOG for each of its
vbuckets and last GET_ALL_VB_SEQNOS filtered to ACTIVE. Only the active's numbers mean
anything: a replica lags it, and a stream is read from the active anyway. A vbucket the node
does not list as active (its active moved since the map was read: a failover) is asked again
after the map is read again, and so is a vbucket whose node does not answer (killed, and not
failed over yet), with backoff, until ``options.node_timeout_s``: a failover takes a few
seconds, so a micro-batch planned during one waits for it rather than failing. After that the
error names the nodes and vbuckets that did not answer.

A node outside any cluster serves a one-node map placing every vbucket on itself; a node that
serves none is asked for everything, as before clusters existed.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Coroutine
from typing import Final, TypeVar

from changefeed.consumer.connection import Connection
from changefeed.consumer.dcp_map import MapFollower
from changefeed.consumer.handshake import connect
from changefeed.protocol.dcp import WireVbucketState, decode_failover_log, encode_get_failover_log
from changefeed.protocol.errors import error_for_status
from changefeed.protocol.frame import Frame
from changefeed.protocol.kv import decode_vb_seqnos, encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status
from changefeed.spark.cluster import dial_seed, retriable
from changefeed.spark.offsets import Offsets, VbOffset
from changefeed.spark.options import SourceOptions

AGENT: Final = "changefeed-spark"
RETRY_BACKOFF_S: Final = (0.05, 0.1, 0.2, 0.5, 1.0)  # then 1 s between attempts
NODE_CONNECT_TIMEOUT_S: Final = 5.0
ALL_STATES: Final = 0  # GET_ALL_VB_SEQNOS filter: every vbucket the node holds (not dead)
_T = TypeVar("_T")


class NodeUnavailableError(ConnectionError):
    """Some vbuckets' active nodes did not answer within ``nodeTimeoutS``; names them."""


class _Planner:
    """One planning round: the map, a connection per node asked, and why each vbucket that is
    still missing could not be answered (for the error)."""

    def __init__(self, options: SourceOptions, seed: tuple[str, int], deadline: float) -> None:
        self.options = options
        self.deadline = deadline  # loop time
        self.map = MapFollower(seed[0], seed[1], self._dial)
        self.conns: dict[str, Connection] = {}
        self.why: dict[int, str] = {}  # vb -> what the last attempt found

    async def _dial(self, host: str, port: int) -> Connection:
        o = self.options
        return await connect(
            host, port, agent=AGENT, user=o.user, password=o.password, bucket=o.bucket,
            timeout_s=NODE_CONNECT_TIMEOUT_S,
        )  # fmt: skip

    @classmethod
    async def open(cls, options: SourceOptions) -> _Planner:
        """A planner holding the first answering seed's connection, with the map read."""
        conn, seed = await dial_seed(options, AGENT)
        planner = cls(options, seed, 0.0)
        try:
            await planner.map.read(conn)
        except BaseException:
            await conn.close()
            raise
        planner.conns[planner.map.bootstrap] = conn
        return planner

    async def latest(self) -> tuple[Offsets, int]:
        """``fetch_latest``'s answer, asked over this planner's connections."""
        options = self.options
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + options.node_timeout_s
        self.why = {}
        cluster_map = self.map.cluster_map
        if cluster_map is not None:
            total = cluster_map.vbuckets
        else:  # a node without a map: it holds the whole bucket
            conn = await self._conn(self.map.bootstrap)
            seqnos = await self._all_seqnos(conn, options.node_timeout_s)
            total = max(seqnos) + 1 if seqnos else 0
        missing = options.vbucket_ids(total)
        latest: Offsets = {}
        for attempt in range(1_000_000):  # bounded by the deadline
            by_server: dict[str, list[int]] = {}
            for vb in missing:
                server = self.map.route(vb)
                if server is None:
                    rev = self.map.cluster_map.rev if self.map.cluster_map else 0
                    self.why[vb] = f"no active node in map rev {rev}"
                else:
                    by_server.setdefault(server, []).append(vb)
            found = await asyncio.gather(*(self.ask(s, v) for s, v in by_server.items()))
            for answered in found:
                latest.update(answered)
            missing = [vb for vb in missing if vb not in latest]
            if not missing:
                return latest, total
            left_s = self.deadline - loop.time()
            if left_s <= 0:
                raise NodeUnavailableError(_unavailable(options, missing, self.why))
            # The last attempt is at the deadline: giving up when the next backoff would pass
            # it stopped after ~1 s of a 2 s nodeTimeoutS on a slow machine.
            await asyncio.sleep(
                min(RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)], left_s)
            )
            await self.map.refresh()
        raise AssertionError("unreachable: the deadline ends the loop")

    async def high_seqnos(self, timeout_s: float) -> dict[int, int]:
        """The high seqnos of the vbuckets the nodes asked last hold active (all they hold,
        without a map): one request per connection, no failover logs, each answered within
        ``timeout_s`` (a paused node must not hold a long poll past its window)."""
        answers = await asyncio.gather(
            *(self._all_seqnos(c, timeout_s) for c in list(self.conns.values()))
        )
        highs: dict[int, int] = {}
        for answer in answers:
            highs.update(answer)
        return highs

    async def _all_seqnos(self, conn: Connection, timeout_s: float) -> dict[int, int]:
        state = ALL_STATES if self.map.cluster_map is None else WireVbucketState.ACTIVE
        opaque = conn.next_opaque()
        request = encode_request(
            Opcode.GET_ALL_VB_SEQNOS, opaque=opaque, extras=struct.pack(">I", state)
        )
        answer = await conn.request(request, opaque, timeout_s=timeout_s)
        if answer.status != Status.SUCCESS:
            raise error_for_status(answer.status, "vbucket seqnos")
        return dict(decode_vb_seqnos(answer.value))

    async def close(self) -> None:
        conns, self.conns = list(self.conns.values()), {}
        for conn in conns:
            await conn.close()

    async def _conn(self, server: str) -> Connection:
        conn = self.conns.get(server)
        if conn is not None and conn.closed is None:
            return conn
        conn = await self._dial(*self.map.address(server))
        self.conns[server] = conn
        return conn

    async def ask(self, server: str, vbuckets: list[int]) -> dict[int, VbOffset]:
        """High seqno and vb_uuid of those of ``vbuckets`` that ``server`` holds active (all
        it holds, without a map); the others get a reason in ``self.why``."""
        try:
            conn = await self._conn(server)
            return await self._ask_on(conn, server, vbuckets)
        except Exception as error:
            if not retriable(error):
                raise
            dropped = self.conns.pop(server, None)
            if dropped is not None:
                await dropped.close()
            for vb in vbuckets:
                self.why[vb] = f"node {server} did not answer ({error!r})"
            return {}

    async def _ask_on(
        self, conn: Connection, server: str, vbuckets: list[int]
    ) -> dict[int, VbOffset]:
        logs: list[asyncio.Future[Frame]] = []
        for vb in vbuckets:
            opaque = conn.next_opaque()
            logs.append(conn.expect(opaque))
            conn.send(encode_get_failover_log(vb, opaque, dcp=False))
        # Last, so that a vbucket still active now was active when its log was read (a node
        # only stops being active, it does not become active again without a failover).
        state = ALL_STATES if self.map.cluster_map is None else WireVbucketState.ACTIVE
        opaque = conn.next_opaque()
        seqnos_answer = conn.expect(opaque)
        conn.send(
            encode_request(Opcode.GET_ALL_VB_SEQNOS, opaque=opaque, extras=struct.pack(">I", state))
        )
        futures = [*logs, seqnos_answer]
        try:
            await conn.drain()
            async with asyncio.timeout_at(
                max(self.deadline, asyncio.get_running_loop().time() + 1)
            ):
                answers = [await future for future in logs]
                seqnos = await seqnos_answer
        except BaseException:
            for future in futures:  # none left pending, no exception left unretrieved
                if not future.done():
                    future.cancel()
                elif not future.cancelled():
                    future.exception()
            raise
        if seqnos.status != Status.SUCCESS:
            raise error_for_status(seqnos.status, f"vbucket seqnos of {server}")
        active = dict(decode_vb_seqnos(seqnos.value))
        rev = self.map.cluster_map.rev if self.map.cluster_map is not None else 0
        out: dict[int, VbOffset] = {}
        for vb, answer in zip(vbuckets, answers, strict=True):
            if answer.status == Status.NOT_MY_VBUCKET:
                self.map.learn(answer.value)
                self.why[vb] = f"node {server} answered NOT_MY_VBUCKET (map rev {rev})"
                continue
            if answer.status != Status.SUCCESS:
                raise error_for_status(answer.status, f"failover log of vbucket {vb} on {server}")
            if vb not in active:
                self.why[vb] = f"node {server} no longer holds it active (map rev {rev})"
                continue
            uuid = decode_failover_log(answer.value)[0][0]
            high = active[vb]
            out[vb] = VbOffset(uuid, high, high, high)
        return out


async def fetch_latest(options: SourceOptions) -> tuple[Offsets, int]:
    """Return ``({vb: VbOffset at its active's high seqno}, number of vbuckets in the bucket)``.

    Raises:
        NodeUnavailableError: some vbuckets' actives did not answer within ``nodeTimeoutS``
            (a node down and not failed over); the message names the nodes and vbuckets.
        SeedsUnreachableError: no seed answered.
        StatusError: a node refused us for good (authentication, no such bucket).
    """
    planner = await _Planner.open(options)
    try:
        return await planner.latest()
    finally:
        await planner.close()


def fetch_latest_sync(options: SourceOptions) -> tuple[Offsets, int]:
    return asyncio.run(fetch_latest(options))


class LatestPoller:
    """``fetch_latest`` for a streaming query's planning, which asks before every micro-batch:
    the map and one connection per node stay open between calls (a fresh connection and
    handshake cost ~5 ms of CPU per call, every ~10 ms while a query with a zero trigger
    interval is idle), and ``wait_for_change`` long-polls the nodes' high seqnos.

    Not thread-safe; Spark's runner calls a stream reader from one thread. Any error closes the
    connections (the next call opens new ones) and propagates, as ``fetch_latest``'s do.
    """

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._planner: _Planner | None = None

    def fetch(self) -> tuple[Offsets, int]:
        return self._run(self._fetch())

    def wait_for_change(self, seen: Offsets, window_s: float, every_s: float) -> bool:
        """Ask the nodes for their high seqnos every ``every_s`` until some vbucket is past
        ``seen`` (True: something new, or a node to ask again) or ``window_s`` passed (False)."""
        return self._run(self._wait(seen, window_s, every_s))

    def close(self) -> None:
        if self._loop is None:
            return
        if self._planner is not None:
            self._loop.run_until_complete(self._planner.close())
            self._planner = None
        self._loop.close()
        self._loop = None

    def _run(self, work: Coroutine[None, None, _T]) -> _T:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        try:
            return self._loop.run_until_complete(work)
        except BaseException:
            if self._planner is not None:
                planner, self._planner = self._planner, None
                self._loop.run_until_complete(planner.close())
            raise

    async def _fetch(self) -> tuple[Offsets, int]:
        if self._planner is not None:
            try:
                return await self._planner.latest()
            except Exception as error:
                if not retriable(error):
                    raise
                # A connection kept since the last call broke (a node restarted): start over
                # from the seeds, as a fresh ``fetch_latest`` would.
                planner, self._planner = self._planner, None
                await planner.close()
        self._planner = await _Planner.open(self.options)
        return await self._planner.latest()

    async def _wait(self, seen: Offsets, window_s: float, every_s: float) -> bool:
        if self._planner is None:
            return True
        loop = asyncio.get_running_loop()
        until = loop.time() + window_s
        while (left_s := until - loop.time()) > 0:  # bounded by the window
            try:
                highs = await self._planner.high_seqnos(min(left_s, self.options.node_timeout_s))
            except Exception as error:
                if not retriable(error):
                    raise
                # A node gone or silent: its kept connection is dropped with the planner, and
                # a full fetch from the seeds finds out what changed.
                planner, self._planner = self._planner, None
                await planner.close()
                return True
            # Only the vbuckets the query reads (``seen``'s): writes elsewhere wake no one.
            if any(seqno > seen[vb].seqno for vb, seqno in highs.items() if vb in seen):
                return True
            await asyncio.sleep(every_s)
        return False


def _unavailable(options: SourceOptions, missing: list[int], why: dict[int, str]) -> str:
    """One message naming, per reason (usually: a node), the vbuckets it kept unanswered."""
    by_reason: dict[str, list[int]] = {}
    for vb in missing:
        by_reason.setdefault(why.get(vb, "no answer"), []).append(vb)
    parts = [f"{reason}: vbuckets {_ranges(vbs)}" for reason, vbs in sorted(by_reason.items())]
    return (
        f"no active node answered for {len(missing)} vbuckets within nodeTimeoutS="
        f"{options.node_timeout_s:g} s (a node down and not failed over?): " + "; ".join(parts)
    )


def _ranges(vbuckets: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    for vb in sorted(vbuckets):
        if out and out[-1].split("-")[-1] == str(vb - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{vb}"
        else:
            out.append(str(vb))
    return ",".join(out)
