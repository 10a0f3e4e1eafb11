"""Node configuration: defaults, overridden by a TOML file, overridden by command-line flags.

Every field has a documented default so ``changefeed serve`` with no arguments runs the embedded
single-node default. Unknown keys in the file are an error naming the key (a typo must not be
silently ignored).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from changefeed import limits
from changefeed.vbmap import REPLICAS_MAX


class ConfigError(ValueError):
    """Bad configuration; the message names the file and key."""


@dataclass(frozen=True, slots=True)
class NodeConfig:
    data_dir: Path = Path("./data")
    host: str = "127.0.0.1"
    port: int = 11210  # memcached binary protocol (KV + DCP)
    metrics_port: int = 0  # Prometheus text format at /metrics; 0 = disabled
    bucket: str = "default"
    vbuckets: int = 64  # Couchbase uses 1024; 64 keeps a laptop node light
    durable: bool = True  # fsync each flush batch (False: survives kill -9, not power loss)
    checkpoint_quota_bytes: int = 256 * 1024 * 1024  # memory for all checkpoints of the bucket
    # The open checkpoint is closed once it holds this many accounted bytes (limits.py).
    checkpoint_max_bytes: int = limits.CHECKPOINT_MAX_BYTES_DEFAULT
    flush_batch_bytes: int = limits.FLUSH_BATCH_BYTES_MAX  # accounted bytes per group commit
    noop_idle_timeout_s: float = 360.0  # dcp_idle_timeout (dcp-wire.md §8.2)
    # An authenticated KV (non-DCP) connection with no request for this long is closed; 0: never.
    idle_timeout_s: float = 300.0
    # Connections over this are accepted and closed at once, with a logged refusal.
    max_connections: int = limits.CONNECTIONS_MAX_DEFAULT
    map_size_bytes: int = limits.STORAGE_MAP_SIZE_BYTES_DEFAULT
    # A damaged data file (missing, empty, truncated) stops the start unless this is set; then
    # the damaged files are moved aside and the node starts empty (new vbucket histories).
    start_fresh: bool = False
    # Compaction (server/compactor.py): tombstones deleted this long ago are purged (Couchbase's
    # metadata purge interval, 3 days); a consumer resuming below the purge seqno rolls back to 0.
    tombstone_purge_age_s: float = 3 * 24 * 3600.0
    compaction_interval_s: float = 3600.0  # how often to look for such tombstones; 0 = never
    expiry_pager_interval_s: float = 60.0  # expire documents without a read (expiry_pager.py)
    users_file: Path | None = None  # default: <data_dir>/users.json
    log_level: str = "INFO"
    # Cluster membership (changefeed.cluster). Without `etcd` the node is alone: every vbucket
    # active, the map kept in memory. With it, vbuckets the map has not given this node yet
    # start dead, and the orchestrator (one per cluster, elected) places them.
    node_name: str = "n0"  # unique in the cluster; names the node in the map and etcd
    # e.g. http://127.0.0.1:2379; several members of one etcd comma-separated (the node moves
    # to the next when one fails); https: the node's tls_cert/tls_key/tls_ca are used there
    etcd: str = ""
    cluster: str = "default"  # the cluster's name (its etcd key prefix)
    replicas: int = 0  # replica copies per vbucket the orchestrator places (0..3)
    expected_nodes: int = 1  # the orchestrator writes the first map once this many are up
    # A replica is in the in-sync set while it was fully caught up this recently (Kafka's
    # replica.lag.time.max.ms; time, not item count).
    replica_lag_max_s: float = 10.0
    # A node whose etcd lease lapses this long is failed over (its in-sync replicas promoted);
    # also the orchestrator's lease. etcd leases are whole seconds, at least 2.
    failover_timeout_s: int = 5
    # Fail a node over once its crash is confirmed (cluster/rules.py CrashConfirmer: its port
    # refuses connections), its lease revoked, instead of waiting out the lease.
    crash_failover: bool = True
    # Disk backfills of replica streams (catch-up) stream at most this fast, so catching up
    # cannot starve front-end traffic; 0 = no limit.
    replication_catchup_bytes_per_s: int = 64 * 1024 * 1024
    # Shared-memory fan-out to local readers (changefeed.ipc, docs/ipc.md): the bucket's vbuckets
    # in this many contiguous groups, each offered as the service <bucket>-<port>-g<i>; 0 = off.
    shm_groups: int = 0
    shm_dir: Path | None = None  # where services live; default $CHANGEFEED_IPC_DIR or /tmp/...
    shm_slots: int = 16  # ring slots per group (readers hold at most shm_slots - 1 at once)
    shm_slot_bytes: int = 2 * 1024 * 1024  # one Arrow batch each; /dev/shm use = slots x bytes
    shm_max_subscribers: int = 8  # readers per group (transaction logs)
    shm_persisted_only: bool = True  # publish a row once it is persisted (never taken back)
    # Connection budgets (server/admission.py; limits.py gives the arithmetic): slots for
    # connections still authenticating (one more closes the oldest), slots only admins (and so
    # replica streams) may take, and connections one user may hold.
    max_unauthenticated_connections: int = limits.UNAUTHENTICATED_CONNECTIONS_MAX_DEFAULT
    admin_connections_reserved: int = limits.ADMIN_CONNECTIONS_RESERVED_DEFAULT
    max_connections_per_user: int = limits.CONNECTIONS_PER_USER_MAX_DEFAULT
    # TLS on the client/DCP port (Couchbase's 11207): a second listener beside `port`, serving
    # the same protocol; 0 = no TLS listener. Needs the node's certificate chain and key (PEM;
    # `changefeed certs create` makes them).
    tls_port: int = 0
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # The cluster's CA (PEM): the TLS listener asks clients for a certificate and one this CA
    # signed authenticates its peer as that node, without SASL (nodes replicate this way);
    # replica feeds dial other nodes' TLS ports trusting it. None: no client certificates,
    # replica feeds dial plain TCP with the password.
    tls_ca: Path | None = None
    # Certificates the CA revoked (a CRL, PEM; `changefeed certs revoke` writes it): a client
    # certificate listed there is refused in the handshake. Needs tls_ca.
    tls_crl: Path | None = None

    @property
    def users_path(self) -> Path:
        return self.users_file or self.data_dir / "users.json"

    def validate(self) -> NodeConfig:
        if not 1 <= self.vbuckets <= limits.VBUCKETS_MAX:
            raise ConfigError(f"vbuckets must be 1..{limits.VBUCKETS_MAX}, not {self.vbuckets}")
        if not 0 <= self.port <= 65535 or not 0 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"port {self.port} / metrics_port {self.metrics_port}: ports must be 0..65535"
            )
        if self.checkpoint_quota_bytes < 1024 * 1024:
            raise ConfigError("checkpoint_quota_bytes must be at least 1 MiB")
        if self.checkpoint_max_bytes <= 0:
            raise ConfigError(f"checkpoint_max_bytes {self.checkpoint_max_bytes} must be positive")
        if not 0 < self.flush_batch_bytes <= limits.STORAGE_BATCH_BYTES_MAX // 64:
            raise ConfigError(
                f"flush_batch_bytes {self.flush_batch_bytes} must be 1.."
                f"{limits.STORAGE_BATCH_BYTES_MAX // 64}"
            )
        if self.idle_timeout_s < 0:
            raise ConfigError(f"idle_timeout_s {self.idle_timeout_s} must be >= 0 (0: never)")
        if self.max_connections < 1:
            raise ConfigError(f"max_connections {self.max_connections} must be at least 1")
        for key in (
            "max_unauthenticated_connections",
            "admin_connections_reserved",
            "max_connections_per_user",
        ):
            if getattr(self, key) < (0 if key == "admin_connections_reserved" else 1):
                raise ConfigError(f"{key} {getattr(self, key)} must be positive")
        self._validate_tls()
        if self.noop_idle_timeout_s <= 0:
            raise ConfigError(f"noop_idle_timeout_s {self.noop_idle_timeout_s} must be positive")
        if not self.node_name or not self.node_name.isprintable() or " " in self.node_name:
            raise ConfigError(f"node_name {self.node_name!r} must be printable, without spaces")
        if not 0 <= self.replicas <= REPLICAS_MAX:
            raise ConfigError(f"replicas {self.replicas} must be 0..{REPLICAS_MAX}")
        if self.expected_nodes < 1:
            raise ConfigError(f"expected_nodes {self.expected_nodes} must be at least 1")
        if self.etcd:
            self._validate_etcd()
        if not 2 <= self.failover_timeout_s <= 3600:
            raise ConfigError(f"failover_timeout_s {self.failover_timeout_s} must be 2..3600")
        if not 0 < self.replica_lag_max_s < float("inf"):
            raise ConfigError(f"replica_lag_max_s {self.replica_lag_max_s} must be positive")
        if self.replication_catchup_bytes_per_s < 0:
            raise ConfigError(
                f"replication_catchup_bytes_per_s {self.replication_catchup_bytes_per_s} "
                "must be >= 0 (0: no limit)"
            )
        if self.shm_groups:
            self._validate_shm()
        for key in ("tombstone_purge_age_s", "compaction_interval_s", "expiry_pager_interval_s"):
            value = getattr(self, key)
            if not 0 <= value < float("inf"):
                raise ConfigError(f"{key} {value} must be a number of seconds >= 0")
        return self

    def _validate_etcd(self) -> None:
        # cluster/metadata.py parses each endpoint; here only what a node needs to use them.
        endpoints = [part.strip() for part in self.etcd.split(",")]
        for endpoint in endpoints:
            if not endpoint.startswith(("http://", "https://")):
                raise ConfigError(
                    f"etcd endpoint {endpoint!r} must be a URL like http://127.0.0.1:2379 "
                    "(several: comma-separated)"
                )
        secure = {endpoint.startswith("https://") for endpoint in endpoints}
        if len(secure) > 1:
            raise ConfigError(f"etcd {self.etcd!r} mixes http and https endpoints")
        if True in secure and None in (self.tls_cert, self.tls_key, self.tls_ca):
            raise ConfigError(
                f"etcd {self.etcd!r} is https: the node presents its tls_cert and tls_key and "
                "trusts tls_ca there (give all three)"
            )

    def _validate_tls(self) -> None:
        if not 0 <= self.tls_port <= 65535:
            raise ConfigError(f"tls_port {self.tls_port} must be 0..65535 (0: no TLS listener)")
        if self.tls_port and self.tls_port == self.port:
            raise ConfigError(f"tls_port {self.tls_port} must differ from port {self.port}")
        if self.tls_port and (self.tls_cert is None or self.tls_key is None):
            raise ConfigError("tls_port needs tls_cert and tls_key (PEM files)")
        if not self.tls_port and (self.tls_cert is not None or self.tls_key is not None):
            raise ConfigError("tls_cert and tls_key need tls_port (the TLS listener's port)")
        if self.tls_ca is not None and not self.tls_port:
            raise ConfigError("tls_ca needs tls_port (nodes present their certificates there)")
        if self.tls_crl is not None and self.tls_ca is None:
            raise ConfigError("tls_crl needs tls_ca (the CA whose revocations it lists)")

    def _validate_shm(self) -> None:
        from changefeed.ipc.layout import Geometry

        if not 0 <= self.shm_groups <= self.vbuckets:
            raise ConfigError(f"shm_groups {self.shm_groups} must be 0..vbuckets ({self.vbuckets})")
        largest = tuple(range(-(-self.vbuckets // self.shm_groups)))
        problem = Geometry.problem_of(
            self.shm_slots, self.shm_slot_bytes, self.shm_max_subscribers, largest
        )
        if problem:
            raise ConfigError(f"shared-memory groups: {problem}")


_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "Path": (Path,),
    "Path | None": (Path, type(None)),
}


def _check_type(key: str, value: object, annotation: object, path: Path | None) -> None:
    """A value of the wrong type is an error naming the key, not a crash later."""
    wanted = _TYPES.get(str(annotation))
    assert wanted is not None, (key, annotation)  # every field's annotation is listed above
    wrong_bool = isinstance(value, bool) and bool not in wanted
    if wrong_bool or not isinstance(value, wanted):
        where = f" in {path}" if path else ""
        names = " or ".join(kind.__name__ for kind in wanted)
        raise ConfigError(f"config key {key!r}{where} must be {names}, not {value!r}")


def load_config(path: Path | None, **overrides: Any) -> NodeConfig:
    """Defaults ← TOML file (``[node]`` table or top level) ← non-None ``overrides``.

    Raises:
        ConfigError: unreadable file, unknown key or wrong type.
    """
    values: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise ConfigError(f"cannot read config {path}: {error}") from None
        values.update(raw.get("node", raw))
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name: f for f in fields(NodeConfig)}
    for key in values:
        if key not in known:
            raise ConfigError(f"unknown config key {key!r}" + (f" in {path}" if path else ""))
    for key in ("data_dir", "users_file", "shm_dir", "tls_cert", "tls_key", "tls_ca", "tls_crl"):
        if isinstance(values.get(key), str):
            values[key] = Path(values[key])
    for key, value in values.items():
        _check_type(key, value, known[key].type, path)
    try:
        return replace(NodeConfig(), **values).validate()
    except TypeError as error:
        raise ConfigError(str(error)) from None
