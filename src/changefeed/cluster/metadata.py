"""Cluster metadata on etcd: node membership, the vbucket map, and the orchestrator's election.

Everything of cluster ``C`` lives under ``/changefeed/C/``::

    nodes/<name>    a live node's address (JSON), on the node's lease: it vanishes within one
                    TTL of the node dying, which is how the cluster learns it died
    status/<name>   what the node chooses to publish about itself (JSON), on the same lease
    leader          the orchestrator's name, on its lease, created only if absent
    map             the cluster map (``ClusterMap.to_json``), no lease: it outlives everyone

Why the leader key's *create revision* is in every map write: a lease alone does not make a
lock safe. A leader that stalls (GC, a paused VM, a partition) past its TTL still believes it
leads while etcd has already elected another; Jepsen showed etcd locks used that way let two
holders act at once. So ``write_map`` is one etcd transaction that compares the map key's mod
revision (compare-and-swap: nothing changed since the writer read it) *and* that the leader key
still has the create revision the writer won the election with (the fencing token). A stale
leader's write then fails inside etcd, whatever it believes.

Every request has a deadline (``limits.ETCD_REQUEST_TIMEOUT_S``) and an unreachable etcd is a
``MetadataUnavailableError`` naming the endpoint. Watches (``watch_map``, ``watch_nodes``)
never give up: they re-read and re-watch after a disconnect or a compaction, with backoff, so a
node keeps its last map while etcd is away.

Several endpoints (``http://a:2379,http://b:2379``: the members of one etcd) are tried in turn:
a request that fails on one makes the next request go to the next, and the watches on the one
that failed are closed so they start again there. Each request asks the member to have a raft
leader (gRPC metadata ``hasleader``, as etcd's own client does for watches): a member cut off
from its quorum refuses at once instead of serving a watch that never fires, so the client moves
on to a member that can answer. A lease is the cluster's, not a member's: its keep-alive goes on
through whichever member answers.

TLS (``https://`` endpoints, ``EtcdTls``): the gRPC channel is a secure one that trusts the
cluster CA and presents this process's certificate (a node's own, or the CLI's ``admin``
certificate from ``changefeed certs``): the etcd ``cluster/etcd_server.py`` starts with TLS
refuses clients without a certificate its CA signed. aetcd 1.0 opens only insecure channels,
so ``_Client`` opens the channel itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import aetcd.rtypes
import aetcd.utils
import aetcd.watcher
import grpc  # type: ignore[import-untyped]  # no stubs installed
import grpc.aio  # type: ignore[import-untyped]
from aetcd import rpc

from changefeed import limits
from changefeed.cluster.failover import InSyncRecord
from changefeed.cluster.rules import promotable_members
from changefeed.vbmap import ClusterMap, NodeAddress

log = logging.getLogger(__name__)

T = TypeVar("T")
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
NODE_DOC_BYTES_MAX = 64 * 1024  # a node's address or status document
# gRPC reconnects with exponential backoff up to 120 s by default: after a long etcd outage a
# node would notice etcd is back only minutes later. Cap it at the watch retry backoff.
GRPC_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": int(limits.ETCD_RETRY_BACKOFF_MIN_S * 1000),
    "grpc.min_reconnect_backoff_ms": int(limits.ETCD_RETRY_BACKOFF_MIN_S * 1000),
    "grpc.max_reconnect_backoff_ms": int(limits.ETCD_RETRY_BACKOFF_MAX_S * 1000),
}


class MetadataUnavailableError(ConnectionError):
    """etcd did not answer (refused, timed out, unavailable); the message names the endpoint."""


def _stop_if_cancelled() -> None:
    """Raise CancelledError if this task was asked to stop: a library that turned the
    cancellation into an error (gRPC does) must not make a retry loop outlive it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def _cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it ends, without swallowing a cancellation of our own
    (``suppress(CancelledError)`` around ``await task`` would)."""
    task.cancel()
    await asyncio.wait({task})


async def _next_event(events: AsyncIterator[Any], switched: asyncio.Event) -> Any | None:
    """The watch's next event; None when it ended or the client moved to another member
    (``switched``): a watch left on a member the client gave up on may never fire."""
    if switched.is_set():
        return None
    next_event = asyncio.ensure_future(anext(events))
    switch = asyncio.ensure_future(switched.wait())
    try:
        await asyncio.wait((next_event, switch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (next_event, switch):
            task.cancel()
    if not next_event.done() or next_event.cancelled():
        return None
    try:
        return next_event.result()
    except StopAsyncIteration:
        return None


def _check_name(kind: str, name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"{kind} name {name!r} must be 1-128 letters, digits, '_', '.', ':' or '-', "
            "starting with a letter or digit"
        )
    return name


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``http://host:port``, ``https://host:port`` (or ``host:port``) as (host, port).

    Raises:
        ValueError: not such a URL (paths are not supported), naming it.
    """
    return _split_endpoint(endpoint)[1:]


def _split_endpoint(endpoint: str) -> tuple[str, str, int]:
    refused = ValueError(f"etcd endpoint {endpoint!r} is not http://HOST:PORT or https://HOST:PORT")
    try:
        url = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
        port, host = url.port, url.hostname
    except ValueError:  # a bad port or a bad IPv6 literal
        raise refused from None
    if url.scheme not in ("http", "https") or not host or port is None:
        raise refused
    if url.path not in ("", "/") or url.query or url.fragment:
        raise refused
    return url.scheme, host, port


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """The endpoints of one etcd (a comma-separated string, or a list), each checked, as
    ``scheme://host:port`` in the order given, without repeats.

    Raises:
        ValueError: none given, a malformed one, or http and https mixed (naming them).
    """
    given = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    urls: list[str] = []
    for endpoint in (part.strip() for part in given):
        scheme, host, port = _split_endpoint(endpoint)
        url = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
        if url not in urls:
            urls.append(url)
    if not urls:
        raise ValueError(f"no etcd endpoint in {endpoints!r}")
    if len({url.partition(":")[0] for url in urls}) > 1:
        raise ValueError(f"etcd endpoints {','.join(urls)} mix http and https")
    return urls


@dataclass(frozen=True, slots=True)
class EtcdTls:
    """What a client of an etcd that serves TLS presents and trusts (PEM files): the cluster
    CA, and a certificate (with its chain) and key the CA signed, which etcd asks for.

    Args:
        server_name: the name to check the member's certificate for; default the endpoint's
            host (an IP address is checked against the certificate's IP addresses).
    """

    ca: Path
    cert: Path
    key: Path
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials from the files (read now).

        Raises:
            ValueError: a file cannot be read (naming it).
        """
        contents = []
        for path in (self.ca, self.key, self.cert):
            try:
                contents.append(path.read_bytes())
            except OSError as error:
                raise ValueError(f"cannot read etcd TLS file {path}: {error.strerror}") from None
        ca, key, chain = contents
        return grpc.ssl_channel_credentials(ca, key, chain)


# Every request asks the member to have a raft leader (etcd's rpctypes.MetadataRequireLeaderKey):
# one cut from its quorum answers "no leader" at once instead of leaving a watch silent.
REQUIRE_LEADER = (("hasleader", "true"),)


class _Client(aetcd.Client):  # type: ignore[misc]  # aetcd has no type hints
    """aetcd's client on a channel we open: a secure one with ``credentials`` (aetcd 1.0 opens
    only insecure ones), and requests that require a leader. Its RPC methods are aetcd's."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout_s: float,
        credentials: grpc.ChannelCredentials | None,
        server_name: str | None,
    ) -> None:
        options: dict[str, Any] = dict(GRPC_OPTIONS)
        if server_name is not None:
            options["grpc.ssl_target_name_override"] = server_name
        super().__init__(host, port, timeout=timeout_s, options=options)
        self._target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._credentials = credentials

    async def connect(self) -> None:
        # No await in here: channels connect lazily, so no other task can interleave (aetcd's
        # own connect guards that with a flag because it may authenticate first).
        if self._connected.is_set():
            return
        options = list(self._options.items())
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(self._target, options=options)
        else:
            channel = grpc.aio.secure_channel(self._target, self._credentials, options=options)
        self.channel = channel
        self.metadata = REQUIRE_LEADER
        self.kvstub = rpc.KVStub(channel)
        self.clusterstub = rpc.ClusterStub(channel)
        self.leasestub = rpc.LeaseStub(channel)
        self.maintenancestub = rpc.MaintenanceStub(channel)
        self._watcher = aetcd.watcher.Watcher(
            rpc.WatchStub(channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()


class _KeptLease:
    """A lease kept alive by a task; ``lost`` is set once etcd may have let it expire.

    Lost means: etcd said the lease is gone (TTL 0), or no keep-alive succeeded for a whole
    TTL (counted from when the last successful one was *sent*, so we declare it lost no later
    than etcd expires it), or ``check`` (run after each keep-alive) said so.
    """

    def __init__(
        self,
        metadata: ClusterMetadata,
        lease_id: int,
        ttl_s: int,
        what: str,
        check: Callable[[], Awaitable[str | None]] | None = None,
        granted_s: float | None = None,
    ) -> None:
        self.metadata = metadata
        self.lease_id = lease_id
        self.ttl_s = ttl_s
        self.what = what
        self.lost = asyncio.Event()
        self.reason = ""
        self.callbacks: list[Callable[[str], None]] = []
        self._check = check
        # When the last keep-alive etcd answered was sent (the grant's request, at first): the
        # fence counts from here (cluster/rules.py membership_valid_until).
        self.renewal_sent_s = time.monotonic() if granted_s is None else granted_s
        self._expires_at = self.renewal_sent_s + ttl_s
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._keep(), name=f"lease {what}")

    async def _keep(self) -> None:
        interval = self.ttl_s / 3
        timeout = min(limits.ETCD_REQUEST_TIMEOUT_S, interval)
        failing = False
        delay = interval
        while not (self.lost.is_set() or self._closed):
            _stop_if_cancelled()
            await asyncio.sleep(delay)
            sent = time.monotonic()
            try:
                reply = await self.metadata._call(
                    self.metadata.client.refresh_lease(self.lease_id), "lease keep-alive", timeout
                )
                if reply is None or reply.TTL <= 0:
                    self._lose("etcd says the lease expired")
                    return
                self._expires_at = sent + reply.TTL
                self.renewal_sent_s = sent
                delay = interval
                if failing:
                    log.info("%s: lease keep-alive works again", self.what)
                    failing = False
                if self._check is not None:
                    problem = await self._check()
                    if problem:
                        self._lose(problem)
                        return
            except MetadataUnavailableError as error:
                if time.monotonic() >= self._expires_at:
                    self._lose(f"no keep-alive for a whole TTL ({self.ttl_s} s): {error}")
                    return
                # Try again soon, backing off, not a third of the TTL later: the next
                # endpoint may answer, and a keep-alive that timed out took a third already
                # (another third's wait would pass the fence, rules.membership_valid_until).
                delay = limits.ETCD_RETRY_BACKOFF_MIN_S if not failing else min(interval, delay * 2)
                if not failing:
                    log.warning("%s: lease keep-alive failed, retrying: %s", self.what, error)
                    failing = True

    def _lose(self, reason: str) -> None:
        if self.lost.is_set():
            return
        self.reason = reason
        self.lost.set()
        if self._closed:
            return
        log.warning("%s: lost (%s)", self.what, reason)
        for callback in self.callbacks:
            try:
                callback(reason)
            except Exception:  # a broken observer must not stop the others
                log.exception("%s: lost-callback failed", self.what)

    async def close(self, *, revoke: bool = True) -> None:
        """Stop keeping the lease and, with `revoke`, revoke it (its keys go at once; without,
        they go when the TTL runs out); sets ``lost`` without calling the callbacks (a chosen
        end, not a loss)."""
        self._closed = True
        await _cancel_and_wait(self._task)
        self._lose("closed")
        if not revoke:
            return
        with contextlib.suppress(MetadataUnavailableError):  # then it expires by itself
            await self.metadata._call(self.metadata.client.revoke_lease(self.lease_id), "revoke")


class Membership:
    """This node's place in the member list, for as long as its lease lives.

    Attributes:
        node: the address registered.
        lost: set when the lease is gone (the node is no longer a member; register again to
            rejoin) or after ``close``.
    """

    def __init__(
        self,
        metadata: ClusterMetadata,
        node: NodeAddress,
        lease: _KeptLease,
        registration: int = 0,
    ) -> None:
        self.metadata = metadata
        self.node = node
        self._lease = lease
        # The etcd revision of this registration's put: the mod revision of nodes/<name> it
        # left (rules.refuses_activation compares activations with a process's first one).
        self.registration = registration

    @property
    def lost(self) -> asyncio.Event:
        return self._lease.lost

    @property
    def lease_id(self) -> int:
        return self._lease.lease_id

    @property
    def renewal_sent_s(self) -> float:
        """Monotonic time the last keep-alive etcd answered was sent (the fence's origin)."""
        return self._lease.renewal_sent_s

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` when the lease is lost (not on ``close``)."""
        self._lease.callbacks.append(callback)

    async def put_status(self, status: Mapping[str, object]) -> None:
        """Publish ``status`` (JSON-able) under ``status/<name>``, on the membership lease.

        Raises:
            MetadataUnavailableError: etcd did not answer.
            ValueError: the document is larger than 64 KiB.
        """
        data = json.dumps(dict(status), sort_keys=True).encode()
        if len(data) > NODE_DOC_BYTES_MAX:
            raise ValueError(f"node status of {len(data)} bytes exceeds {NODE_DOC_BYTES_MAX}")
        key = self.metadata.key(f"status/{self.node.name}")
        await self.metadata._call(
            self.metadata.client.put(key, data, lease=self.lease_id), "put status"
        )

    async def close(self, *, revoke: bool = True) -> None:
        """Leave the cluster: now (revoke the lease; the member and status keys go with it),
        or, without `revoke`, when the lease's TTL runs out — what a node that stops does, so a
        restart within the failover timeout is not a failover."""
        await self._lease.close(revoke=revoke)


class Leadership:
    """The orchestrator's term, won by creating the leader key.

    Attributes:
        candidate: who won (the leader key's value).
        token: the leader key's create revision: the fencing token every map write compares.
        lost: set when the term may be over (lease gone, key deleted or taken over), or after
            ``resign``. Stop acting at once; ``write_map`` is fenced anyway.
    """

    def __init__(
        self, metadata: ClusterMetadata, candidate: str, token: int, lease: _KeptLease
    ) -> None:
        self.metadata = metadata
        self.candidate = candidate
        self.token = token
        self.lost = lease.lost
        self._lease = lease

    def __repr__(self) -> str:
        state = "lost" if self.lost.is_set() else "held"
        return f"Leadership({self.candidate!r}, token {self.token}, {state})"

    @property
    def lease_id(self) -> int:
        return self._lease.lease_id

    @property
    def reason(self) -> str:
        """Why the term ended ("" while it is held)."""
        return self._lease.reason

    async def resign(self) -> None:
        """End the term: delete the leader key if it is still ours, and revoke the lease."""
        key = self.metadata.key("leader")
        t = self.metadata.client.transactions
        with contextlib.suppress(MetadataUnavailableError):  # the lease revoke (or TTL) frees it
            await self.metadata._call(
                self.metadata.client.transaction(
                    compare=[t.create(key) == self.token], success=[t.delete(key)], failure=[]
                ),
                "resign",
            )
        await self._lease.close()


@dataclass(frozen=True, slots=True)
class Activation:
    """Who a map made a vbucket's active, and the registration (the etcd mod revision of its
    ``nodes/<name>``) it had then: the process that decision vouched for."""

    node: str
    registration: int


@dataclass(frozen=True, slots=True)
class VbucketFailoverRequest:
    """A stored ``vbfailover/<vb>``: the node that refused to become the vbucket's active, its
    process's registration then, and the key's etcd mod revision (a delete compares it, so a
    request put again since is not lost)."""

    node: str
    registration: int
    revision: int


@dataclass(frozen=True, slots=True)
class StoredMap:
    """The map as stored: the map, its key's mod revision, its activations by vbucket."""

    map: ClusterMap
    revision: int
    activations: dict[int, Activation]


def activations_of(
    new: ClusterMap, stored: StoredMap | None, registrations: Mapping[str, int]
) -> tuple[dict[int, Activation], dict[str, int]]:
    """The activations to store with `new` over `stored` (None: the first map): each vbucket
    whose active is unchanged keeps its activation; one whose active changes (or has none
    recorded) gets the new active's current registration (0 when it is not registered: no
    process of it is vouched for). Also the registrations those new activations were judged
    by, which the map's write compares."""
    activations: dict[int, Activation] = {}
    judged: dict[str, int] = {}
    for vb in range(new.vbuckets):
        active = new.active(vb)
        if active is None:
            continue
        kept = stored.activations.get(vb) if stored is not None else None
        before = stored.map.active(vb) if stored is not None else None
        if kept is not None and before is not None and before.name == active.name == kept.node:
            activations[vb] = kept
            continue
        registration = registrations.get(active.name, 0)
        activations[vb] = Activation(active.name, registration)
        if registration:
            judged[active.name] = registration
    return activations, judged


@dataclass(frozen=True, slots=True)
class PromotableInSync:
    """The in-sync records as the orchestrator may promote from them (`promotable_in_sync`).

    Attributes:
        records: per vbucket, its record with only the promotable members.
        revisions: per vbucket, its record's etcd mod revision.
        registrations: each registered node's registration revision (read after the records).
        held_back: per vbucket, the members left out because they registered again after
            the record (restarted, or lost their lease): promotable again once the active
            writes a newer record naming them (rules.InSyncKeeper).
    """

    records: dict[int, InSyncRecord]
    revisions: dict[int, int]
    registrations: dict[str, int]
    held_back: dict[int, frozenset[str]]


class ClusterMetadata:
    """One etcd client for cluster ``cluster``. Create with ``connect``; ``close`` when done.

    Memberships and leaderships made through it are revoked by ``close``. ``client`` is the
    aetcd client of the endpoint in use; ``endpoint`` names it.
    """

    def __init__(
        self,
        clients: Sequence[Any],
        endpoints: Sequence[str],
        cluster: str,
        timeout_s: float,
    ) -> None:
        assert len(clients) == len(endpoints) >= 1, (len(clients), endpoints)
        self.clients = list(clients)
        self.endpoints = list(endpoints)
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.prefix = f"/changefeed/{cluster}/"
        self.switches = 0  # moves to another endpoint (logs, tests)
        self._current = 0
        self._leases: list[_KeptLease] = []
        self._switched = asyncio.Event()  # set, and replaced, on each move to another member

    @property
    def client(self) -> Any:
        return self.clients[self._current]

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._current]

    @classmethod
    async def connect(
        cls,
        endpoint: str | Sequence[str],
        cluster: str,
        *,
        timeout_s: float = limits.ETCD_REQUEST_TIMEOUT_S,
        tls: EtcdTls | None = None,
    ) -> ClusterMetadata:
        """Connect to the etcd at ``endpoint`` (``http://127.0.0.1:PORT``; several, of one
        etcd, comma-separated or as a list; ``https://`` with ``tls``) and check it answers
        (trying each endpoint in turn).

        Raises:
            ValueError: a malformed endpoint or cluster name, https without ``tls`` or http
                with it, or a TLS file that cannot be read.
            MetadataUnavailableError: no endpoint answered within ``timeout_s``.
        """
        endpoints = parse_endpoints(endpoint)
        _check_name("cluster", cluster)
        secure = endpoints[0].startswith("https:")
        if secure and tls is None:
            raise ValueError(f"etcd {','.join(endpoints)} is https: give its CA and a certificate")
        if tls is not None and not secure:
            raise ValueError(f"etcd {','.join(endpoints)} is not https, yet TLS files were given")
        credentials = tls.credentials() if tls is not None else None
        clients = []
        for url in endpoints:
            _scheme, host, port = _split_endpoint(url)
            server_name = tls.server_name if tls is not None else None
            clients.append(
                _Client(
                    host,
                    port,
                    timeout_s=timeout_s,
                    credentials=credentials,
                    server_name=server_name,
                )
            )
        metadata = cls(clients, endpoints, cluster, timeout_s)
        try:
            for attempt in range(len(endpoints)):
                try:
                    await metadata._call(metadata.client.get(metadata.key("map")), "connect")
                    break
                except MetadataUnavailableError:
                    if attempt + 1 == len(endpoints):
                        raise
        except BaseException:
            await metadata.close()
            raise
        return metadata

    async def close(self) -> None:
        """Revoke this client's leases (memberships, leaderships) still kept, and close the
        connections. (A lease closed without revoking stays until its TTL.)"""
        for lease in self._leases:
            if not lease.lost.is_set():
                await lease.close()
        self._leases.clear()
        for client in self.clients:
            await self._close_client(client)

    async def _close_client(self, client: Any) -> None:
        with contextlib.suppress(Exception):  # closing a dead channel may complain
            async with asyncio.timeout(self.timeout_s):
                await client.close()

    async def __aenter__(self) -> ClusterMetadata:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def key(self, suffix: str) -> bytes:
        return (self.prefix + suffix).encode()

    def _fail_over(self, failed: int) -> None:
        """After a request to endpoint ``failed`` failed: use the next endpoint from now on
        (unless another failure already moved on) and tell the watches, which start again on
        the next (a watch on a cut-off member may stay silent). The failed member's channel
        stays open and reconnects by itself: closing it under requests and watches that were
        just made on it left a watch that never fired nor failed (a node stopped applying maps
        after switching members twice in a second)."""
        if len(self.clients) == 1 or self._current != failed:
            return
        self._current = (failed + 1) % len(self.clients)
        self.switches += 1
        log.warning(
            "etcd at %s failed: using %s", self.endpoints[failed], self.endpoints[self._current]
        )
        switched, self._switched = self._switched, asyncio.Event()
        switched.set()

    async def _call(self, awaitable: Awaitable[T], what: str, timeout_s: float | None = None) -> T:
        """Await one etcd request with a deadline; any failure becomes one line naming etcd,
        and the next request goes to the next endpoint."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        used, endpoint = self._current, self.endpoint
        try:
            # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation that
            # races with the result, and a loop around it would then never stop
            async with asyncio.timeout(timeout_s):
                result = await awaitable
            # A library may swallow our cancellation and return (aetcd creates a watch through
            # 3.11's wait_for, which loses a cancel racing with its result): stop anyway, or
            # a caller's loop would wait on forever in a task asked to end.
            _stop_if_cancelled()
            return result
        except TimeoutError:
            self._fail_over(used)
            raise MetadataUnavailableError(
                f"etcd at {endpoint} did not answer {what} in {timeout_s:g} s"
            ) from None
        except aetcd.exceptions.ClientError as error:
            _stop_if_cancelled()  # gRPC turns our cancellation into an RPC error
            self._fail_over(used)
            detail = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise MetadataUnavailableError(f"etcd at {endpoint}: {what} failed: {detail}") from None

    async def _grant(self, ttl_s: int, what: str) -> int:
        if ttl_s < limits.ETCD_LEASE_TTL_S_MIN:
            raise ValueError(f"lease TTL {ttl_s} s is below {limits.ETCD_LEASE_TTL_S_MIN} s")
        lease = await self._call(self.client.lease(ttl_s), f"lease grant for {what}")
        return int(lease.id)

    # -- membership ---------------------------------------------------------------------------

    async def register_node(
        self, node: NodeAddress, ttl_s: int = limits.ETCD_LEASE_TTL_S_DEFAULT
    ) -> Membership:
        """Put ``nodes/<name>`` on a new lease kept alive in a task.

        Raises:
            MetadataUnavailableError: etcd did not answer.
            ValueError: a bad node name or TTL.
        """
        _check_name("node", node.name)
        granted_s = time.monotonic()
        lease_id = await self._grant(ttl_s, f"node {node.name}")
        document = {"name": node.name, "host": node.host, "port": node.port}
        if node.tls_port:
            document["tls_port"] = node.tls_port
        put = await self._call(
            self.client.put(
                self.key(f"nodes/{node.name}"), json.dumps(document).encode(), lease=lease_id
            ),
            "register node",
        )
        lease = _KeptLease(
            self, lease_id, ttl_s, f"member {node.name} of {self.cluster}", granted_s=granted_s
        )
        self._leases.append(lease)
        registration = int(put.header.revision)
        log.info(
            "node %s (%s) joined cluster %s (registration: etcd revision %d)",
            node.name, node.server, self.cluster, registration,
        )  # fmt: skip
        return Membership(self, node, lease, registration)

    async def live_nodes(self) -> dict[str, NodeAddress]:
        """The registered nodes, by name (sorted)."""
        got = await self._call(self.client.get_prefix(self.key("nodes/")), "list nodes")
        return self._nodes_of({kv.key: kv for kv in got})

    async def registrations(self) -> dict[str, int]:
        """Each registered node's registration: the etcd mod revision of its ``nodes/<name>``
        key, which only `register_node` writes (a restart, or a lease lost and taken again,
        writes it anew: rules.promotable_members)."""
        got = await self._call(self.client.get_prefix(self.key("nodes/")), "list registrations")
        return self._registrations_of({kv.key: kv for kv in got})

    async def watch_registrations(self) -> AsyncGenerator[dict[str, int], None]:
        """`registrations` now, then again after each change (never ends; survives outages)."""
        last: dict[str, int] | None = None
        prefix = self.key("nodes/")
        async for state in self._follow(prefix, aetcd.utils.prefix_range_end(prefix)):
            found = self._registrations_of(state)
            if found != last:
                last = found
                yield found

    def _registrations_of(self, kvs: Mapping[bytes, Any]) -> dict[str, int]:
        prefix = self.key("nodes/")
        return {
            key[len(prefix) :].decode(errors="replace"): int(kv.mod_revision)
            for key, kv in sorted(kvs.items())
        }

    async def watch_nodes(self) -> AsyncGenerator[dict[str, NodeAddress], None]:
        """The live nodes now, then again after each change (never ends; survives outages)."""
        last: dict[str, NodeAddress] | None = None
        prefix = self.key("nodes/")
        async for state in self._follow(prefix, aetcd.utils.prefix_range_end(prefix)):
            nodes = self._nodes_of(state)
            if nodes != last:
                last = nodes
                yield nodes

    def _nodes_of(self, kvs: Mapping[bytes, Any]) -> dict[str, NodeAddress]:
        nodes: dict[str, NodeAddress] = {}
        for key in sorted(kvs):
            try:
                document = json.loads(kvs[key].value)
                node = NodeAddress(
                    str(document["name"]),
                    str(document["host"]),
                    int(document["port"]),
                    int(document.get("tls_port", 0)),
                )
                if not 0 < node.port <= 65535:
                    raise ValueError(f"port {node.port}")
            except (ValueError, KeyError, TypeError, RecursionError) as error:
                log.error("ignoring malformed member %r: %r", key, error)
                continue
            nodes[node.name] = node
        return nodes

    async def node_statuses(self) -> dict[str, dict[str, Any]]:
        """What each live node published with ``Membership.put_status``, by name."""
        got = await self._call(self.client.get_prefix(self.key("status/")), "list statuses")
        statuses: dict[str, dict[str, Any]] = {}
        for kv in got:
            name = kv.key.decode(errors="replace").rpartition("/")[2]
            with contextlib.suppress(ValueError):
                document = json.loads(kv.value)
                if isinstance(document, dict):
                    statuses[name] = document
        return dict(sorted(statuses.items()))

    # -- the map ------------------------------------------------------------------------------

    def _parse_map(self, value: bytes) -> ClusterMap:
        if len(value) > limits.CLUSTER_MAP_BYTES_MAX:
            raise ValueError(
                f"cluster map at {self.prefix}map is {len(value)} bytes, over "
                f"{limits.CLUSTER_MAP_BYTES_MAX}"
            )
        try:
            return ClusterMap.from_json(json.loads(value))
        except (ValueError, RecursionError) as error:  # RecursionError: absurd nesting
            raise ValueError(f"cluster map at {self.prefix}map: {error!r}"[:500]) from None

    def _parse_activations(self, value: bytes) -> dict[int, Activation]:
        """The map document's ``activations`` (`write_map`); {} for a map written without."""
        try:
            found = json.loads(value).get("activations", {})
            return {
                int(vb): Activation(str(entry[0]), int(entry[1])) for vb, entry in found.items()
            }
        except (ValueError, TypeError, AttributeError, IndexError, KeyError) as error:
            raise ValueError(f"cluster map at {self.prefix}map: activations {error!r}") from None

    async def read_map(self) -> tuple[ClusterMap, int] | None:
        """The current map and the mod revision of its key, or None before the first map.

        Raises:
            MetadataUnavailableError: etcd did not answer.
            ValueError: the stored map is malformed.
        """
        found = await self.read_map_activations()
        return None if found is None else (found.map, found.revision)

    async def read_map_activations(self) -> StoredMap | None:
        """`read_map`, with the activations stored with it (`write_map`)."""
        kv = await self._call(self.client.get(self.key("map")), "read map")
        if kv is None:
            return None
        return self._stored_map(kv.value, int(kv.mod_revision))

    def _stored_map(self, value: bytes, revision: int) -> StoredMap:
        return StoredMap(self._parse_map(value), revision, self._parse_activations(value))

    async def watch_map(self) -> AsyncGenerator[tuple[ClusterMap, int], None]:
        """The current map (waiting for the first one), then each later map, in order, with the
        mod revision of its key. Never ends. After a disconnect or a compaction it re-reads
        the map, so maps written meanwhile may be skipped but never reordered: revisions only
        increase."""
        async for stored in self.watch_map_activations():
            yield stored.map, stored.revision

    async def watch_map_activations(self) -> AsyncGenerator[StoredMap, None]:
        """`watch_map`, each map with the activations stored with it."""
        key = self.key("map")
        last = 0
        async for state in self._follow(key, key + b"\0"):
            kv = state.get(key)
            if kv is None or kv.mod_revision <= last:
                continue
            last = kv.mod_revision
            yield self._stored_map(kv.value, int(kv.mod_revision))

    async def write_map(
        self,
        new: ClusterMap,
        expected_mod_revision: int | None,
        leadership: Leadership,
        *,
        absent: Collection[str] = (),
        in_sync_revisions: Mapping[int, int] | None = None,
        registrations: Mapping[str, int] | None = None,
        answered: Collection[int] = (),
        reinstated: Mapping[int, Activation] | None = None,
    ) -> int | None:
        """Store ``new`` if the map key is still at ``expected_mod_revision`` (None: there is no
        map yet), ``leadership`` still holds the leader key (its create revision and value),
        and none of the nodes in ``absent`` has registered again (a map planned while a node
        was gone — a failover of it — must not land once it is back and may serve), and the
        in-sync record of each vbucket in ``in_sync_revisions`` is still at that mod revision
        (0: none yet): a promotion planned on a record the active has replaced since must be
        planned again (rules.SilenceDetector), and each node in ``registrations`` is still
        registered at that mod revision: a node promoted must not have registered again (a
        restart) between the plan and the write (rules.promotable_members). One etcd
        transaction.

        The map document also carries its *activations*: per vbucket, the active and the
        registration (its ``nodes/<name>`` mod revision) it had when a map first made it that
        vbucket's active — read here for every vbucket whose active changes, carried over
        from the stored map for the others, and compared in the transaction, so it is exact.
        A node whose process registered after its activation does not take the vbucket from
        it (rules.refuses_activation); `reinstated` sets some explicitly (failover.FailoverPlan
        .reinstated: judged on the record's revision, so that node's disk decides). The
        per-vbucket failover requests of the vbuckets in `answered` (``vbfailover/<vb>``) are
        deleted in the same transaction.

        Returns:
            the map key's new mod revision (truthy), or None when the map changed meanwhile or
            the leadership is gone (read the map again, or stop acting).

        Raises:
            ValueError: ``new.rev`` is not above the stored map's rev (or below 1): a bug in the
                caller, not a race.
            MetadataUnavailableError: etcd did not answer (the write may or may not have
                happened: read the map to know).
        """
        if new.rev < 1:
            raise ValueError(f"map rev {new.rev} must be at least 1")
        if leadership.lost.is_set() or leadership.metadata.cluster != self.cluster:
            return None
        key, leader = self.key("map"), self.key("leader")
        t = self.client.transactions
        stored: StoredMap | None = None
        if expected_mod_revision is None:
            map_compare = t.create(key) == 0
        else:
            stored = await self.read_map_activations()
            if stored is None or stored.revision != expected_mod_revision:
                return None
            if new.rev <= stored.map.rev:
                raise ValueError(
                    f"map rev {new.rev} is not above the stored map's rev {stored.map.rev}"
                )
            map_compare = t.mod(key) == expected_mod_revision
        activations, activated = activations_of(
            new, stored, await self.registrations() if new.vbuckets else {}
        )
        activations.update(reinstated or {})
        document = {
            **new.to_json(),
            "activations": {str(vb): [a.node, a.registration] for vb, a in activations.items()},
        }
        data = json.dumps(document, separators=(",", ":")).encode()
        if len(data) > limits.CLUSTER_MAP_BYTES_MAX:
            raise ValueError(f"cluster map of {len(data)} bytes exceeds the limit")
        succeeded, responses = await self._call(
            self.client.transaction(
                compare=[
                    map_compare,
                    t.create(leader) == leadership.token,
                    t.value(leader) == leadership.candidate.encode(),
                    *(t.create(self.key(f"nodes/{name}")) == 0 for name in sorted(absent)),
                    *(
                        t.mod(self.key(f"insync/{vb}")) == revision
                        for vb, revision in sorted((in_sync_revisions or {}).items())
                    ),
                    *(
                        t.mod(self.key(f"nodes/{name}")) == revision
                        for name, revision in sorted({**activated, **(registrations or {})}.items())
                    ),
                ],
                success=[
                    t.put(key, data),
                    t.get(key),
                    *(t.delete(self.key(f"vbfailover/{vb}")) for vb in sorted(set(answered))),
                ],
                failure=[],
            ),
            "write map",
        )
        if not succeeded:
            log.info(
                "map rev %d by %s not written: the map or the leadership changed",
                new.rev,
                leadership.candidate,
            )
            return None
        revision = int(responses[1][0][1].mod_revision)
        log.info(
            "map rev %d written by %s (token %d, etcd revision %d)",
            new.rev,
            leadership.candidate,
            leadership.token,
            revision,
        )
        return revision

    # -- in-sync sets and failover requests ---------------------------------------------------

    async def put_in_sync(
        self,
        vb: int,
        active: str,
        members: list[str],
        map_mod_revision: int,
        registrations: Mapping[str, int] | None = None,
    ) -> int | None:
        """Record `vb`'s confirmed in-sync set (``insync/<vb>``, not on a lease: the
        orchestrator needs it after the active is gone, as Kafka keeps the ISR in the
        controller), only if the map key is still at `map_mod_revision` — the map the active
        serves by — so a deposed active's record never lands (cluster/rules.py InSyncKeeper) —
        and, given `registrations` (node name to the mod revision of its registration the
        writer judged by), only if every member's registration is still that one: a member
        that registered again unseen (it restarted and may have lost what it acknowledged
        from memory) would be made promotable by a record written after its registration.

        Returns:
            The record's mod revision (truthy) if written (members registered after it are
            not promotable from it: rules.promotable_members); None when the map or a
            member's registration changed (the record was not written).

        Raises:
            MetadataUnavailableError: etcd did not answer (the write may have happened).
        """
        document = {"active": active, "members": sorted(members), "map": map_mod_revision}
        t = self.client.transactions
        key = self.key(f"insync/{vb}")
        compare = [t.mod(self.key("map")) == map_mod_revision]
        if registrations is not None:  # an absent key compares as mod revision 0
            compare += [
                t.mod(self.key(f"nodes/{member}")) == registrations.get(member, 0)
                for member in sorted(members)
            ]
        succeeded, responses = await self._call(
            self.client.transaction(
                compare=compare,
                success=[t.put(key, json.dumps(document).encode()), t.get(key)],
                failure=[],
            ),
            "put in-sync set",
        )
        if not succeeded:
            return None
        return int(responses[1][0][1].mod_revision)

    async def in_sync_sets(self) -> dict[int, InSyncRecord]:
        """Every vbucket's last published in-sync set, with only its promotable members
        (`promotable_in_sync`); malformed entries are skipped."""
        return (await self.promotable_in_sync()).records

    async def in_sync_sets_and_revisions(
        self,
    ) -> tuple[dict[int, InSyncRecord], dict[int, int]]:
        """Every vbucket's in-sync record as written (every member), and its etcd mod
        revision (for ``write_map``'s ``in_sync_revisions``; a vbucket with none is absent:
        0). To promote from, `promotable_in_sync`."""
        return await self.in_sync_records()

    async def promotable_in_sync(self) -> PromotableInSync:
        """Every vbucket's in-sync record with only the members that may be promoted from it:
        those registered before it was written (rules.promotable_members). The registrations
        are read after the records, so a node that registers in between counts as registered
        after its record (it is left out: the safe side)."""
        records, revisions = await self.in_sync_records()
        registrations = await self.registrations()
        promotable: dict[int, InSyncRecord] = {}
        held_back: dict[int, frozenset[str]] = {}
        for vb, record in records.items():
            members = promotable_members(record.members, revisions[vb], registrations)
            promotable[vb] = InSyncRecord(record.active, members)
            if record.members - members:
                held_back[vb] = record.members - members
        return PromotableInSync(promotable, revisions, registrations, held_back)

    async def in_sync_records(self) -> tuple[dict[int, InSyncRecord], dict[int, int]]:
        """Every vbucket's last published in-sync record as written (every member), and its
        etcd mod revision."""
        got = await self._call(self.client.get_prefix(self.key("insync/")), "list in-sync sets")
        found: dict[int, InSyncRecord] = {}
        revisions: dict[int, int] = {}
        for kv in got:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                vb = int(kv.key.decode().rpartition("/")[2])
                document = json.loads(kv.value)
                members = frozenset(str(m) for m in document["members"])
                found[vb] = InSyncRecord(str(document["active"]), members)
                revisions[vb] = int(kv.mod_revision)
        return found, revisions

    async def vbuckets_not_fully_in_sync(self) -> list[int] | None:
        """Vbuckets whose last published in-sync set lacks some replica of the map (None:
        no map yet). Until it is empty a failover of their active would be refused, so a
        test, demo or benchmark that kills an active waits for it."""
        stored = await self.read_map()
        if stored is None:
            return None
        cmap = stored[0]
        sets = await self.in_sync_sets()
        return [
            vb
            for vb in range(cmap.vbuckets)
            if vb not in sets or {r.name for r in cmap.replica_nodes(vb)} - set(sets[vb].members)
        ]

    async def leases_of(self, node: str) -> list[int]:
        """The leases `node` holds: its membership, and the leadership if it leads."""
        leases: list[int] = []
        member = await self._call(self.client.get(self.key(f"nodes/{node}")), "read member")
        if member is not None and member.lease:
            leases.append(int(member.lease))
        leader = await self._call(self.client.get(self.key("leader")), "read leader")
        if leader is not None and leader.value == node.encode() and leader.lease:
            leases.append(int(leader.lease))
        return leases

    async def leadership_lease(self, node: str) -> int | None:
        """The lease of the leader key if `node` leads (None otherwise). Revoking it ends that
        term at once; the leader's map writes are fenced by the key's create revision, so a
        leader that does not know yet writes nothing (`write_map`)."""
        leader = await self._call(self.client.get(self.key("leader")), "read leader")
        if leader is None or leader.value != node.encode() or not leader.lease:
            return None
        return int(leader.lease)

    async def revoke(self, lease_ids: Collection[int]) -> None:
        """Revoke leases (their keys go at once): a confirmed crash (rules.CrashConfirmer)."""
        for lease_id in lease_ids:
            with contextlib.suppress(MetadataUnavailableError):  # gone already, or it expires
                await self._call(self.client.revoke_lease(lease_id), "revoke lease")

    async def request_failover(self, node: str, *, force: bool = False) -> None:
        """Ask the orchestrator to fail `node` over (``changefeed cluster failover``)."""
        _check_name("node", node)
        document = json.dumps({"force": force}).encode()
        await self._call(self.client.put(self.key(f"failover/{node}"), document), "failover")

    async def failover_requests(self) -> dict[str, bool]:
        """Pending failover requests: node name -> force."""
        got = await self._call(self.client.get_prefix(self.key("failover/")), "failover list")
        found: dict[str, bool] = {}
        for kv in got:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                found[kv.key.decode().rpartition("/")[2]] = bool(json.loads(kv.value)["force"])
        return found

    async def clear_failover_request(self, node: str) -> None:
        await self._call(self.client.delete(self.key(f"failover/{node}")), "failover clear")

    async def request_vbucket_failover(self, vb: int, node: str, registration: int) -> None:
        """`node` (whose process registered at etcd revision `registration`) asks for `vb`'s
        failover: it refused to become its active (rules.refuses_activation). Kept until the
        orchestrator answers it (`write_map`'s `answered`) or finds it stale."""
        _check_name("node", node)
        if vb < 0:
            raise ValueError(f"vbucket {vb} is negative")
        document = json.dumps({"node": node, "registration": registration}).encode()
        await self._call(
            self.client.put(self.key(f"vbfailover/{vb}"), document), "vbucket failover"
        )

    async def vbucket_failover_requests(self) -> dict[int, str]:
        """Pending per-vbucket failover requests: vbucket -> the node that refused it."""
        return {vb: r.node for vb, r in (await self.stored_vbucket_failover_requests()).items()}

    async def stored_vbucket_failover_requests(self) -> dict[int, VbucketFailoverRequest]:
        """Pending per-vbucket failover requests as stored, with their mod revisions."""
        got = await self._call(
            self.client.get_prefix(self.key("vbfailover/")), "vbucket failover list"
        )
        found: dict[int, VbucketFailoverRequest] = {}
        for kv in got:
            with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
                vb = int(kv.key.decode().rpartition("/")[2])
                document = json.loads(kv.value)
                found[vb] = VbucketFailoverRequest(
                    str(document["node"]), int(document["registration"]), int(kv.mod_revision)
                )
        return found

    async def clear_vbucket_failover_request(
        self, vb: int, revision: int, leadership: Leadership | None = None
    ) -> bool:
        """Delete `vb`'s request if it is still the one read (etcd mod revision `revision`)
        and, when `leadership` is given, that term still holds the leader key (the
        orchestrator's deletes are fenced like its map writes). Returns whether it was
        deleted: False when it was put again since or the term is over."""
        t = self.client.transactions
        key, leader = self.key(f"vbfailover/{vb}"), self.key("leader")
        compare = [t.mod(key) == revision]
        if leadership is not None:
            if leadership.lost.is_set():
                return False
            compare += [
                t.create(leader) == leadership.token,
                t.value(leader) == leadership.candidate.encode(),
            ]
        succeeded, _ = await self._call(
            self.client.transaction(compare=compare, success=[t.delete(key)], failure=[]),
            "vbucket failover clear",
        )
        return bool(succeeded)

    # -- the orchestrator's election ----------------------------------------------------------

    async def leader(self) -> tuple[str, int] | None:
        """The current leader's name and fencing token, or None."""
        kv = await self._call(self.client.get(self.key("leader")), "read leader")
        return None if kv is None else (kv.value.decode(errors="replace"), int(kv.create_revision))

    async def campaign(
        self, candidate: str, ttl_s: int = limits.ETCD_LEASE_TTL_S_DEFAULT
    ) -> Leadership:
        """Wait until ``candidate`` is the leader: create the leader key on our lease if it is
        absent, else wait for it to go (a deletion, or a bounded wait) and try again. Retries
        through etcd outages; cancel to give up.

        Raises:
            ValueError: a bad candidate name or TTL.
        """
        _check_name("candidate", candidate)
        key = self.key("leader")
        t = self.client.transactions
        lease: _KeptLease | None = None
        backoff = limits.ETCD_RETRY_BACKOFF_MIN_S
        try:
            while True:
                _stop_if_cancelled()
                try:
                    if lease is None or lease.lost.is_set():
                        lease_id = await self._grant(ttl_s, f"candidate {candidate}")
                        lease = _KeptLease(self, lease_id, ttl_s, f"leader {candidate}")
                    succeeded, responses = await self._call(
                        self.client.transaction(
                            compare=[t.create(key) == 0],
                            success=[
                                t.put(key, candidate.encode(), lease=lease.lease_id),
                                t.get(key),
                            ],
                            failure=[t.get(key)],
                        ),
                        "campaign",
                    )
                    found = responses[-1]
                    current = found[0][1] if found else None
                    if succeeded:
                        assert current is not None  # read in the same transaction
                        return self._won(candidate, int(current.create_revision), lease)
                    if current is not None:
                        await self._wait_deleted(key, int(current.mod_revision) + 1, ttl_s)
                    backoff = limits.ETCD_RETRY_BACKOFF_MIN_S
                except MetadataUnavailableError as error:
                    log.warning("%s: campaign: %s; retrying in %.1f s", candidate, error, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, limits.ETCD_RETRY_BACKOFF_MAX_S)
        except BaseException:
            if lease is not None:
                await lease.close()
            raise

    def _won(self, candidate: str, token: int, lease: _KeptLease) -> Leadership:
        key = self.key("leader")

        async def still_leader() -> str | None:
            kv = await self._call(self.client.get(key), "check leader")
            if kv is None:
                return "the leader key is gone"
            if int(kv.create_revision) != token or kv.value != candidate.encode():
                return f"the leader key now belongs to {kv.value.decode(errors='replace')!r}"
            return None

        lease._check = still_leader
        lease.what = f"leadership of {candidate} (token {token})"
        self._leases.append(lease)
        log.info("%s leads cluster %s (token %d)", candidate, self.cluster, token)
        return Leadership(self, candidate, token, lease)

    async def _wait_deleted(self, key: bytes, start_revision: int, timeout_s: float) -> None:
        """Return when ``key`` is deleted at or after ``start_revision``, or after
        ``timeout_s`` (the caller then looks again). The watch's own timeout is the normal
        end of a wait, so it is caught before `_call` would report it as etcd failing."""

        async def watch() -> None:
            with contextlib.suppress(aetcd.exceptions.WatchTimeoutError):
                await self.client.watch_once(
                    key,
                    timeout=timeout_s,
                    start_revision=start_revision,
                    kind=aetcd.rtypes.EventKind.DELETE,
                )

        await self._call(watch(), "watch leader", timeout_s + self.timeout_s)

    # -- following a key range ----------------------------------------------------------------

    async def _follow(self, key: bytes, range_end: bytes) -> AsyncGenerator[dict[bytes, Any], None]:
        """The range's key-values now, then after each event, forever: read, then watch from
        the next revision; on any failure (etcd away, compaction) back off and start over."""
        backoff = limits.ETCD_RETRY_BACKOFF_MIN_S
        outage = False
        while True:
            _stop_if_cancelled()
            used, switched = self._current, self._switched
            try:
                got = await self._call(self.client.get_range(key, range_end), "read")
                state = {kv.key: kv for kv in got}
                if outage:
                    log.info("etcd at %s is back; watching %r again", self.endpoint, key)
                    outage = False
                yield dict(state)
                watch = await self._call(
                    self.client.watch(
                        key, range_end=range_end, start_revision=got.header.revision + 1
                    ),
                    "watch",
                )
                try:
                    events = aiter(watch)
                    while (event := await _next_event(events, switched)) is not None:
                        backoff = limits.ETCD_RETRY_BACKOFF_MIN_S
                        if event.kind == aetcd.rtypes.EventKind.PUT:
                            state[event.kv.key] = event.kv
                        else:
                            state.pop(event.kv.key, None)
                        yield dict(state)
                finally:
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(self.timeout_s):
                            await watch.cancel()
            except (MetadataUnavailableError, aetcd.exceptions.ClientError) as error:
                self._fail_over(used)  # a watch that broke: the next member may answer
                if not outage:
                    log.warning("watching %r: %s; retrying", key, str(error).splitlines()[0])
                    outage = True
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, limits.ETCD_RETRY_BACKOFF_MAX_S)

    # -- documents of other layers (the collections manifest: cluster/manifest_store.py) -------

    async def read_document(self, suffix: str) -> tuple[bytes, int] | None:
        """The value at ``<prefix><suffix>`` and its mod revision, or None if absent.

        Raises:
            MetadataUnavailableError: etcd did not answer.
        """
        kv = await self._call(self.client.get(self.key(suffix)), f"read {suffix}")
        return None if kv is None else (bytes(kv.value), int(kv.mod_revision))

    async def watch_document(self, suffix: str) -> AsyncGenerator[tuple[bytes, int], None]:
        """The value at ``<prefix><suffix>`` now (once it exists), then each later value, with
        its mod revision, in order (values written during an outage may be skipped, never
        reordered). Never ends; survives outages as `watch_map`."""
        key = self.key(suffix)
        last = 0
        async for state in self._follow(key, key + b"\0"):
            kv = state.get(key)
            if kv is None or kv.mod_revision <= last:
                continue
            last = int(kv.mod_revision)
            yield bytes(kv.value), last

    async def put_document_fenced(
        self, suffix: str, data: bytes, expected_mod_revision: int | None, *, writer: str
    ) -> int | None:
        """Store ``data`` at ``<prefix><suffix>`` under the orchestrator's fence, in one etcd
        transaction: the key is still at ``expected_mod_revision`` (None: absent), the leader
        key still holds the orchestrator and fencing token read here (so the change lands
        within one leadership, ordered with its map writes), and ``writer`` is a registered
        member (a node whose lease lapsed cannot change it).

        Returns:
            the key's new mod revision, or None when one of those did not hold (read again).

        Raises:
            MetadataUnavailableError: etcd did not answer (the write may have happened).
        """
        _check_name("node", writer)
        leader = await self.leader()
        if leader is None:
            return None
        candidate, token = leader
        key, leader_key = self.key(suffix), self.key("leader")
        t = self.client.transactions
        if expected_mod_revision is None:
            document_compare = t.create(key) == 0
        else:
            document_compare = t.mod(key) == expected_mod_revision
        succeeded, responses = await self._call(
            self.client.transaction(
                compare=[
                    document_compare,
                    t.create(leader_key) == token,
                    t.value(leader_key) == candidate.encode(),
                    t.version(self.key(f"nodes/{writer}")) > 0,
                ],
                success=[t.put(key, data), t.get(key)],
                failure=[],
            ),
            f"write {suffix}",
        )
        if not succeeded:
            return None
        return int(responses[1][0][1].mod_revision)
