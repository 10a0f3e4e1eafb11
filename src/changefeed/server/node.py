"""A node: one bucket, its listener, metrics, and an orderly shutdown.

``Node.run()`` opens the bucket (recovering from the data directory), listens for clients and
serves until SIGTERM/SIGINT, then stops accepting, ends DCP streams, flushes every vbucket and
closes the store cleanly, so a restart is a clean one (no new failover entry).
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import logging
import os
import random
import signal
import ssl
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Protocol

from changefeed import limits
from changefeed.server.admission import Admission, Shares
from changefeed.server.authenticator import AuthThrottle
from changefeed.server.bucket import Bucket
from changefeed.server.collection_events import SystemEventWriter
from changefeed.server.compactor import Compactor
from changefeed.server.config import ConfigError, NodeConfig
from changefeed.server.connection import ClientConnection
from changefeed.server.context import ServerContext
from changefeed.server.expiry_pager import ExpiryPager
from changefeed.server.manifest import ManifestStore
from changefeed.server.metrics import admission_gauges, serve_metrics
from changefeed.server.rate_limit import ByteRate
from changefeed.server.replication import ReplicationTracker
from changefeed.server.shm_publisher import ShmPublisher
from changefeed.server.sync_writes import SyncWriteMonitor
from changefeed.server.users import Users, load_or_create_node_secret

log = logging.getLogger("changefeed.node")

DEFAULT_USER = "Administrator"
# A node certificate this close to its end is logged as a warning at every start.
CERT_EXPIRY_WARNING_S = 30 * 24 * 3600.0


# How often a node looks at its certificate, key, CA and CRL files for a change (rotation).
TLS_FILES_CHECK_INTERVAL_S = 2.0


def server_tls_context(
    cert: Path, key: Path, *, ca: Path | None = None, crl: Path | None = None
) -> ssl.SSLContext:
    """The TLS listener's context: the node's certificate chain and key (PEM), TLS 1.2 or
    newer. With ``ca``, clients are asked for a certificate (optional, as Couchbase's
    client certificate auth: SDK clients without one authenticate with SASL); one that is
    presented must chain to ``ca`` (and, with ``crl``, not be revoked there), else the
    handshake fails.

    Raises:
        ConfigError: a file cannot be read or the key does not match the certificate (the
            message names the files).
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as error:  # SSLError: not PEM, or key and cert differ
        reason = error.strerror or getattr(error, "reason", None) or str(error)
        raise ConfigError(f"cannot load TLS certificate {cert} / key {key}: {reason}") from None
    for path, what in ((ca, "CA"), (crl, "CRL")):
        if path is None:
            continue
        try:
            context.load_verify_locations(cafile=path)  # PEM certificates and CRLs alike
        except (OSError, ssl.SSLError) as error:
            reason = error.strerror or getattr(error, "reason", None) or str(error)
            raise ConfigError(f"cannot load TLS {what} {path}: {reason}") from None
    if ca is not None:
        context.verify_mode = ssl.CERT_OPTIONAL
    if crl is not None:
        # The leaf's issuer must have a CRL loaded: `changefeed certs revoke` writes the CA's.
        context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    _warn_if_expiring(cert)
    return context


class NodeTls:
    """A node's TLS settings, reloaded when its files change (certificate rotation).

    ``server`` is what new connections of the TLS listener handshake with; ``client()`` what
    this node dials other nodes with (the cluster CA trusted, its own certificate presented).
    ``reload()`` (SIGHUP, or `watch` seeing a file change) builds both again from the files;
    connections already open keep the settings they started with. A reload that fails (a key
    written but not yet its certificate) keeps the old settings and is tried again.

    Args:
        cert, key, ca, crl: the files (NodeConfig's tls_cert, tls_key, tls_ca, tls_crl).

    Raises:
        ConfigError: the files cannot be used at start.
    """

    def __init__(self, cert: Path, key: Path, ca: Path | None, crl: Path | None) -> None:
        self.files = (cert, key, ca, crl)
        self.reloads = 0  # successful reloads since start (STAT, tests)
        # Called after each successful reload (the node closes revoked peers' connections).
        self.reloaded: list[Callable[[], None]] = []
        self._seen = self._fingerprint()
        self.server = server_tls_context(cert, key, ca=ca, crl=crl)
        self._client = self._client_context()
        self.revoked = _revoked_serials(crl)

    @property
    def authenticates_nodes(self) -> bool:
        """Whether there is a cluster CA: client certificates are checked and nodes dial TLS."""
        return self.files[2] is not None

    def client(self) -> ssl.SSLContext:
        """The settings to dial another node's TLS port with (the current certificate)."""
        assert self._client is not None, "no cluster CA (tls_ca): nodes do not dial TLS"
        return self._client

    def _client_context(self) -> ssl.SSLContext | None:
        from changefeed.consumer.connection import client_tls_context

        cert, key, ca, _crl = self.files
        if ca is None:
            return None
        try:
            return client_tls_context(ca, cert_file=cert, key_file=key)
        except (OSError, ssl.SSLError) as error:
            raise ConfigError(f"cannot load TLS CA {ca} for dialling nodes: {error}") from None

    def _fingerprint(self) -> tuple[tuple[int, int], ...]:
        marks = []
        for path in self.files:
            try:
                stat = path.stat() if path is not None else None
            except OSError:
                stat = None
            marks.append((0, 0) if stat is None else (stat.st_mtime_ns, stat.st_size))
        return tuple(marks)

    def reload(self) -> bool:
        """Build the settings again from the files; True if they are in use now."""
        cert, key, ca, crl = self.files
        seen = self._fingerprint()
        try:
            server = server_tls_context(cert, key, ca=ca, crl=crl)
            client = self._client_context()
            revoked = _revoked_serials(crl)
        except ConfigError as error:
            log.error("TLS files not reloaded (the node keeps its current ones): %s", error)
            return False
        self.server, self._client, self._seen = server, client, seen
        self.revoked = revoked
        self.reloads += 1
        log.info("TLS certificate %s reloaded: new connections use it", cert)
        for listener in self.reloaded:
            listener()
        return True

    def changed(self) -> bool:
        """Whether a file changed since the settings in use were built (or last tried)."""
        return self._fingerprint() != self._seen

    async def watch(self, interval_s: float = TLS_FILES_CHECK_INTERVAL_S) -> None:
        """Reload when a file changes; runs until cancelled."""
        while True:  # the node's file watch; cancelled by Node.stop()
            await asyncio.sleep(interval_s)
            if self.changed() and not self.reload():
                self._seen = self._fingerprint()  # one error line per change, not per check


def _revoked_serials(crl: Path | None) -> frozenset[int]:
    """The serials the CRL lists (the handshake checks new connections itself; these close
    the connections a certificate opened before it was revoked).

    Raises:
        ConfigError: the file is not a PEM CRL.
    """
    if crl is None:
        return frozenset()
    from cryptography import x509

    try:
        revoked = x509.load_pem_x509_crl(crl.read_bytes())
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot load TLS CRL {crl}: {error}") from None
    return frozenset(entry.serial_number for entry in revoked)


def _warn_if_expiring(cert: Path) -> None:
    """Log the node certificate's end if it is past or near: clients will refuse it."""
    from cryptography import x509

    try:
        certificate = x509.load_pem_x509_certificate(cert.read_bytes())
    except (OSError, ValueError):  # load_cert_chain read it; a chain's first block is ours
        return
    left_s = (certificate.not_valid_after_utc - datetime.datetime.now(datetime.UTC)).total_seconds()
    if left_s <= 0:
        log.warning(
            "TLS certificate %s expired on %s: clients will refuse it",
            cert,
            certificate.not_valid_after_utc,
        )
    elif left_s < CERT_EXPIRY_WARNING_S:
        log.warning("TLS certificate %s expires on %s", cert, certificate.not_valid_after_utc)


def load_or_create_users(config: NodeConfig) -> Users:
    """Load the users file; on first start create it with one admin user.

    The first user's password comes from ``CHANGEFEED_PASSWORD`` (default ``password``, logged
    as a warning so nobody runs with it unknowingly).
    """
    path = config.users_path
    if path.exists():
        return Users.load(path)
    users = Users()
    password = os.environ.get("CHANGEFEED_PASSWORD")
    if password is None:
        password = "password"
        log.warning("created %s with user %s / password 'password'", path, DEFAULT_USER)
    users.add(DEFAULT_USER, password)
    users.save(path)
    return users


class Companion(Protocol):
    """Something that runs beside a node for its lifetime (the cluster membership agent):
    started once the node listens, stopped before the node shuts down."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Node:
    """One node: builds the `ServerContext` its connections share and runs the listeners.

    Args:
        config: the node's configuration.
        clock: wall-clock seconds (CAS, expiry, delete times); inject to replay a test.
        rng: draws vb_uuids; a seeded one makes failover logs replayable.
        monotonic: seconds for timeouts and DCP noops.
    """

    def __init__(
        self,
        config: NodeConfig,
        *,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        config.data_dir.mkdir(parents=True, exist_ok=True)
        users = load_or_create_users(config)
        bucket = Bucket.open(config, clock=clock, rng=rng)
        manifests = ManifestStore.open(config.data_dir / config.bucket)  # after a fresh start
        events = SystemEventWriter(bucket)
        manifests.add_listener(events)
        manifests.add_activation_listener(lambda vb: events.catch_up(vb, manifests.current))
        # Background work on the bucket's clock (the one delete and expiry times are taken on).
        self.compactor = Compactor(
            bucket,
            clock=clock,
            interval_s=config.compaction_interval_s,
            purge_age_s=config.tombstone_purge_age_s,
        )
        self.compactor.dropped_collections = manifests.dropped
        self.expiry_pager = ExpiryPager(
            bucket, clock=clock, interval_s=config.expiry_pager_interval_s
        )
        self.context = ServerContext(
            config,
            users,
            bucket,
            monotonic=monotonic,
            port=config.port,
            compactor=self.compactor,
            expiry_pager=self.expiry_pager,
            node_secret=load_or_create_node_secret(config.data_dir),
            auth_throttle=AuthThrottle(clock=monotonic),
            manifests=manifests,
            catchup_rate=ByteRate(config.replication_catchup_bytes_per_s, clock=monotonic),
            replication=ReplicationTracker(
                lambda vb: bucket.vbucket(vb).high_seqno,
                lag_max_s=config.replica_lag_max_s,
                clock=monotonic,
            ),
        )
        context = self.context
        context.sync_writes = SyncWriteMonitor(
            bucket,
            replicas_of=lambda vb: (
                []
                if context.cluster_map is None
                else [n.name for n in context.cluster_map.replica_nodes(vb)]
            ),
            replication=context.replication,
        )
        self.admission = Admission(
            Shares.of(
                config.max_connections,
                config.max_unauthenticated_connections,
                config.admin_connections_reserved,
                config.max_connections_per_user,
            ),
            clock=monotonic,
        )
        self.tls: NodeTls | None = None
        if config.tls_port:
            assert config.tls_cert is not None and config.tls_key is not None  # validate()
            self.tls = NodeTls(config.tls_cert, config.tls_key, config.tls_ca, config.tls_crl)
            self.tls.reloaded.append(self._close_revoked)
        self._tls_watch: asyncio.Task[None] | None = None
        self.tls_port = 0  # the bound TLS port once listening; 0: no TLS listener
        self.context.stat_providers["connections"] = self._connection_stats
        self.context.metric_providers.append(partial(admission_gauges, self.admission))
        self._server: asyncio.Server | None = None
        self._tls_server: asyncio.Server | None = None
        self._metrics: asyncio.Server | None = None
        self._deadlines: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self.shm: ShmPublisher | None = None  # config.shm_groups: local readers (docs/ipc.md)

    def _connection_stats(self) -> list[tuple[str, str]]:
        """STAT connections: the budgets' state and what they closed or refused (admission.py)."""
        admission = self.admission
        shares = admission.shares
        counters = admission.counters()  # also on /metrics: changefeed_connections_<name>
        tls = sum(1 for conn in self.context.connections if getattr(conn, "tls", False))
        # Connections a node certificate authenticated (server/connection.py, --tls-ca).
        by_certificate = sum(1 for c in self.context.connections if getattr(c, "peer_node", None))
        return [
            ("curr_connections", str(len(self.context.connections))),
            ("tls_connections", str(tls)),
            ("node_certificate_connections", str(by_certificate)),
            ("tls_reloads_total", str(0 if self.tls is None else self.tls.reloads)),
            ("unauthenticated", str(admission.unauthenticated)),
            ("authenticated", str(admission.authenticated)),
            ("max_connections", str(self.config.max_connections)),
            ("max_unauthenticated_connections", str(shares.unauthenticated_max)),
            ("authenticated_share", str(shares.authenticated_max)),
            ("admin_share", str(shares.admin_max)),
            ("max_connections_per_user", str(shares.per_user_max)),
            ("closed_unauthenticated_total", str(admission.closed_unauthenticated)),
            ("closed_idle_total", str(admission.closed_idle)),
            ("refused_authentications_total", str(admission.refused)),
            *((key, str(counters[key])) for key in ("admin", "users", "busiest_user")),
        ]

    def _close_revoked(self) -> None:
        """After a reload: close the connections of node certificates the CRL now lists."""
        assert self.tls is not None
        revoked = self.tls.revoked
        for conn in list(self.context.connections):
            serial = getattr(conn, "peer_serial", None)
            if serial is not None and serial in revoked:
                log.warning(
                    "closing %s: node %s's certificate (serial %x) is revoked",
                    getattr(conn, "peer", "?"), getattr(conn, "peer_node", "?"), serial,
                )  # fmt: skip
                conn.close()

    @property
    def port(self) -> int:
        """The bound KV port (config.port until listening; that may be 0 = any)."""
        return self.context.port

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        context = self.context
        context.bucket.start()
        self.compactor.start()
        self.expiry_pager.start()
        admission = self.admission
        self._server = await loop.create_server(
            lambda: ClientConnection(context, admission),
            self.config.host,
            self.config.port,
            backlog=limits.LISTEN_BACKLOG,
        )
        context.port = self._server.sockets[0].getsockname()[1]
        if self.tls is not None:
            tls = self.tls  # the connections run their handshakes (ClientConnection's tls)
            # tls.server is read per connection: a reload serves new connections only.
            self._tls_server = await loop.create_server(
                lambda: ClientConnection(context, admission, tls=tls.server),
                self.config.host,
                self.config.tls_port,
                backlog=limits.LISTEN_BACKLOG,
            )
            self.tls_port = self._tls_server.sockets[0].getsockname()[1]
            context.tls_port = self.tls_port
            log.info("serving TLS on %s:%d", self.config.host, self.tls_port)
            self._tls_watch = loop.create_task(tls.watch(), name="tls-files")
        self._deadlines = loop.create_task(self._check_deadlines())
        if self.config.shm_groups:  # services are named after the bound port
            self.shm = ShmPublisher(
                context.bucket,
                self.config,
                port=context.port,
                backfill_slots=context.backfill_slots,
            )
            self.shm.start()
            self.shm.register_stats(self.context.stat_providers)  # STAT shm
            self.context.metric_providers.append(self.shm.metric_families)  # /metrics
        if self.config.metrics_port:
            self._metrics = await serve_metrics(context, self.config.host, self.config.metrics_port)
        log.info(
            "serving bucket %r (%d vbuckets) on %s:%d, data in %s",
            context.bucket.name,
            self.config.vbuckets,
            self.config.host,
            context.port,
            self.config.data_dir,
        )

    async def run(
        self, *, ready_file: str | None = None, companion: Companion | None = None
    ) -> None:
        """Serve until SIGTERM/SIGINT; then shut down cleanly.

        Args:
            ready_file: written with the bound port once the node serves.
            companion: started after the listener (it needs the port), stopped first.
        """
        tune_interpreter()
        if companion is not None:
            self.context.manifests.joining_cluster = True  # no manifest change before it joins
        await self.start()
        if companion is not None:
            await companion.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopped.set)
        if self.tls is not None:
            loop.add_signal_handler(signal.SIGHUP, self.tls.reload)  # certificate rotation
        if ready_file:
            with open(ready_file, "w") as handle:
                handle.write(str(self.port))
        await self._stopped.wait()
        if companion is not None:
            await companion.stop()
        await self.stop()

    async def _check_deadlines(self) -> None:
        """Every second: close connections past their auth, idle or partial-request deadline."""
        while True:  # the node's deadline checker; cancelled by stop()
            await asyncio.sleep(limits.DEADLINE_CHECK_INTERVAL_S)
            now = self.context.monotonic()
            for conn in list(self.context.connections):
                conn.check_deadlines(now)

    def request_stop(self) -> None:
        self._stopped.set()

    async def stop(self) -> None:
        log.info("shutting down: flushing and closing the store")
        if self._server is not None:
            self._server.close()
        if self._tls_server is not None:
            self._tls_server.close()
        if self._metrics is not None:
            self._metrics.close()
        if self._deadlines is not None:
            self._deadlines.cancel()
        if self._tls_watch is not None:
            self._tls_watch.cancel()
        for conn in list(self.context.connections):
            conn.close()
        await asyncio.sleep(0)
        await self.expiry_pager.stop()  # before the store closes under them
        await self.compactor.stop()
        if self.shm is not None:
            await self.shm.stop()  # publishes what is persisted, then stops offering
        await self.context.bucket.close()


def tune_interpreter() -> None:
    """Set CPython's collector and thread switching for a node process (measured; see
    docs/benchmarks.md, "Interpreter settings").

    - Young objects are collected every `limits.GC_YOUNG_THRESHOLD` allocations, not 700. A
      node builds an item per change it queues and keeps hundreds of thousands alive in its
      checkpoints; with the default the collector re-scanned them so often that building a
      replica's items cost 1.17 instead of 0.65 us each. The hot paths make no cycles, so
      collecting rarely costs no memory that matters; `gc.freeze` keeps what start-up built out
      of every later scan.
    - The GIL switch interval is `limits.GIL_SWITCH_INTERVAL_S`, not 5 ms. The flusher commits on
      a writer thread that gives the GIL up around LMDB calls; each time it wants it back it
      waits out the busy event loop's interval. With 5 ms a commit next to a busy loop took
      5.3x as long as alone, with 0.5 ms 1.8x.
    """
    gc.freeze()
    gc.set_threshold(limits.GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    sys.setswitchinterval(limits.GIL_SWITCH_INTERVAL_S)
