"""Which vbucket a key belongs to, and which node holds each vbucket (the cluster map).

Couchbase hashes a key with CRC32 and keeps 15 bits of the upper half; we do the same so that a
Couchbase-style client computes the same vbucket (ARCHITECTURE.md, vocabulary).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Final

REPLICAS_MAX: Final = 3  # Couchbase's bound on replicas per vbucket

# ``bucketCapabilities`` of the config, as Couchbase spells them: what a node here serves. SDKs
# check these before an operation and refuse it when one is missing (libcouchbase: durable
# writes need "durableWrite"; the C++ core: lookup_in_any_replica needs "subdoc.ReplicaRead").
# Left out on purpose: "couchapi" (no views: an SDK would send view queries to port 8092),
# "xattr" (only virtual attributes are served; a user xattr cannot be written, and SDKs read
# "xattr" as "user xattrs work", e.g. for transactions), "xdcrCheckpointing", "rangeScan" and
# the other subdoc extensions.
BUCKET_CAPABILITIES: Final = (
    "durableWrite",  # durability frames: SyncWrites (server/sync_writes.py)
    "subdoc.ReplicaRead",  # sub-document lookups sent to replicas (lookup_in_*_replica)
    "cbhello",  # HELLO
    "touch",  # TOUCH and GAT
    "cccp",  # the map from GET_CLUSTER_CONFIG and NOT_MY_VBUCKET bodies
    "dcp",  # the DCP family
    "nodesExt",  # the config carries nodesExt
    "collections",  # HELLO Collections, named collections (server/collection_commands.py)
)


def vbucket_for_key(key: bytes, vbuckets: int) -> int:
    """Return the vbucket id of ``key`` in a bucket of ``vbuckets`` partitions.

    Args:
        key: the document key, as bytes.
        vbuckets: number of vbuckets in the bucket (>= 1).
    """
    assert vbuckets >= 1, vbuckets
    vb = ((zlib.crc32(key) >> 16) & 0x7FFF) % vbuckets
    assert 0 <= vb < vbuckets, (vb, vbuckets)
    return vb


@dataclasses.dataclass(frozen=True, slots=True)
class NodeAddress:
    """A node of the cluster as clients reach it.

    Attributes:
        name: the node's stable name (its etcd member key, its data dir's identity).
        host: KV host (loopback in tests).
        port: KV port.
        tls_port: KV/DCP over TLS (Couchbase's ``kvSSL``); 0: none.
    """

    name: str
    host: str
    port: int
    tls_port: int = 0

    @property
    def server(self) -> str:
        """``host:port``, as Couchbase's ``serverList`` spells a node."""
        return f"{self.host}:{self.port}"


@dataclasses.dataclass(frozen=True, slots=True)
class VbMove:
    """A vbucket a rebalance is moving (issue 12): `chain` is where its copies go.

    Nodes in `chain` but not in the map's chain of `vb` are being built: they are fed by the
    active like replicas, but clients, failover and the in-sync set do not count them yet.
    `takeover`: the active has stopped taking writes for `vb` (state pending) so the new
    active receives the last of them before the map makes it active.
    """

    vb: int
    chain: tuple[int, ...]
    takeover: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterMap:
    """Which node holds each vbucket's active and replica copies, at one revision.

    Sans-IO: the orchestrator computes maps, etcd stores them (as `to_json`), nodes apply them
    and clients route by them. `chains[vb]` is a list of indexes into `nodes`: the active first,
    then the replicas in order; -1 marks a copy with no node (too few nodes, or one failed over).
    `rev` increases with every change (a client keeps the highest it has seen).

    Attributes:
        rev: the map's revision.
        nodes: the nodes, in the order chains refer to them.
        chains: per vbucket, the node indexes of its copies, active first.
        replicas: copies per vbucket besides the active (every chain has replicas + 1 entries).
        moves: vbuckets a rebalance is moving now (``VbMove``), at most one per vbucket.
    """

    rev: int
    nodes: tuple[NodeAddress, ...]
    chains: tuple[tuple[int, ...], ...]
    replicas: int = 0
    moves: tuple[VbMove, ...] = ()

    def __post_init__(self) -> None:
        if self.rev < 0:
            raise ValueError(f"map rev {self.rev} is negative")
        if not self.chains:
            raise ValueError("a cluster map needs at least one vbucket")
        if not 0 <= self.replicas <= REPLICAS_MAX:
            raise ValueError(f"replicas {self.replicas} outside 0..{REPLICAS_MAX}")
        for vb, chain in enumerate(self.chains):
            if len(chain) != self.replicas + 1:
                raise ValueError(f"vb {vb}: chain {chain} needs {self.replicas + 1} entries")
            placed = [i for i in chain if i != -1]
            if any(not 0 <= i < len(self.nodes) for i in placed):
                raise ValueError(
                    f"vb {vb}: chain {chain} names a node outside 0..{len(self.nodes) - 1}"
                )
            if len(set(placed)) != len(placed):
                raise ValueError(f"vb {vb}: chain {chain} puts two copies on one node")
        moving = [m.vb for m in self.moves]
        if len(set(moving)) != len(moving) or any(not 0 <= v < len(self.chains) for v in moving):
            raise ValueError(f"moves name vbuckets twice or out of range: {moving}")
        for move in self.moves:
            placed = [i for i in move.chain if i != -1]
            if (
                len(move.chain) != self.replicas + 1
                or len(set(placed)) != len(placed)
                or any(not 0 <= i < len(self.nodes) for i in placed)
            ):
                raise ValueError(f"vb {move.vb}: bad move chain {move.chain}")

    @property
    def vbuckets(self) -> int:
        return len(self.chains)

    def node_index(self, name: str) -> int | None:
        """Index of the node called `name`, or None when it is not in the map."""
        for i, node in enumerate(self.nodes):
            if node.name == name:
                return i
        return None

    def move_of(self, vb: int) -> VbMove | None:
        """The rebalance move of `vb` in progress, if any."""
        return next((m for m in self.moves if m.vb == vb), None)

    def active(self, vb: int) -> NodeAddress | None:
        """The node holding vb's active copy (None while it has none)."""
        index = self.chains[vb][0]
        return self.nodes[index] if index != -1 else None

    def replica_nodes(self, vb: int) -> list[NodeAddress]:
        """The nodes holding vb's replica copies, in chain order (unplaced ones skipped)."""
        return [self.nodes[i] for i in self.chains[vb][1:] if i != -1]

    def role_of(self, name: str, vb: int) -> int | None:
        """0 when `name` holds vb's active, n for its n-th replica, None when it holds no copy."""
        index = self.node_index(name)
        if index is None or index not in self.chains[vb]:
            return None
        return self.chains[vb].index(index)

    def to_json(self) -> dict[str, object]:
        """The map as stored in etcd and in a node's data dir (`from_json` reads it back)."""
        document: dict[str, object] = {
            "rev": self.rev,
            "replicas": self.replicas,
            "nodes": [_node_json(n) for n in self.nodes],
            "chains": [list(chain) for chain in self.chains],
        }
        if self.moves:
            document["moves"] = [
                {"vb": m.vb, "chain": list(m.chain), "takeover": m.takeover} for m in self.moves
            ]
        return document

    @classmethod
    def from_json(cls, data: object) -> ClusterMap:
        """Parse `to_json`'s form.

        Raises:
            ValueError: the document is not a valid map (names what is wrong).
        """
        try:
            assert isinstance(data, dict)
            nodes = tuple(
                NodeAddress(
                    str(n["name"]), str(n["host"]), int(n["port"]), int(n.get("tls_port", 0))
                )
                for n in data["nodes"]
            )
            chains = tuple(tuple(int(i) for i in chain) for chain in data["chains"])
            moves = tuple(
                VbMove(int(m["vb"]), tuple(int(i) for i in m["chain"]), bool(m["takeover"]))
                for m in data.get("moves", ())
            )
            return cls(int(data["rev"]), nodes, chains, int(data["replicas"]), moves)
        except (AssertionError, KeyError, TypeError) as error:
            raise ValueError(f"not a cluster map: {error!r}") from error

    @classmethod
    def single_node(cls, node: NodeAddress, vbuckets: int, rev: int = 1) -> ClusterMap:
        """Every vbucket active on `node`, no replicas (the embedded single-node default)."""
        return cls(rev, (node,), tuple((0,) for _ in range(vbuckets)), 0)

    def couchbase_config(self, bucket: str, this_node: str | None = None) -> dict[str, object]:
        """The map as Couchbase's GET_CLUSTER_CONFIG / NOT_MY_VBUCKET body spells it.

        `vBucketMap` rows are indexes into `serverList` (active first, -1 for no copy), the
        shape SDKs route by; `nodesExt` lists each node's KV port; `thisNode` marks the
        answering node, as Couchbase does; `bucketCapabilities` says what the nodes serve
        (`BUCKET_CAPABILITIES`).
        """
        nodes_ext: list[dict[str, object]] = []
        for n in self.nodes:
            services = {"kv": n.port, "kvSSL": n.tls_port} if n.tls_port else {"kv": n.port}
            entry: dict[str, object] = {"hostname": n.host, "services": services}
            if n.name == this_node:
                entry["thisNode"] = True
            nodes_ext.append(entry)
        return {
            "rev": self.rev,
            "revEpoch": 1,
            "name": bucket,
            "nodeLocator": "vbucket",
            "bucketType": "membase",
            "bucketCapabilitiesVer": "",
            "bucketCapabilities": list(BUCKET_CAPABILITIES),
            "nodes": [
                {"hostname": f"{n.host}:8091", "ports": {"direct": n.port}} for n in self.nodes
            ],
            "nodesExt": nodes_ext,
            "vBucketServerMap": {
                "hashAlgorithm": "CRC",
                "numReplicas": self.replicas,
                "serverList": [n.server for n in self.nodes],
                "vBucketMap": [list(chain) for chain in self.chains],
            },
        }

    @classmethod
    def from_couchbase_config(cls, config: object) -> ClusterMap:
        """Read a Couchbase-format config (what `couchbase_config` writes, or a real one).

        Node names are the ``host:port`` servers (a client has no other name for them).

        Raises:
            ValueError: the document is not a usable config (names what is wrong).
        """
        try:
            assert isinstance(config, dict), "not an object"
            server_map = config["vBucketServerMap"]
            tls_ports = _tls_ports(config.get("nodesExt"))
            nodes = []
            for server in server_map["serverList"]:
                host, _, port = str(server).rpartition(":")
                tls = tls_ports.get(str(server), 0)
                nodes.append(NodeAddress(str(server), host, int(port), tls))
            chains = tuple(tuple(int(i) for i in row) for row in server_map["vBucketMap"])
            return cls(
                int(config.get("rev", 0)), tuple(nodes), chains, int(server_map["numReplicas"])
            )
        except (AssertionError, KeyError, TypeError) as error:
            raise ValueError(f"not a cluster config: {error!r}") from error


def _node_json(node: NodeAddress) -> dict[str, object]:
    document: dict[str, object] = {"name": node.name, "host": node.host, "port": node.port}
    if node.tls_port:
        document["tls_port"] = node.tls_port
    return document


def _tls_ports(nodes_ext: object) -> dict[str, int]:
    """``host:kv`` -> ``kvSSL`` from a config's ``nodesExt`` (entries without one left out)."""
    found: dict[str, int] = {}
    for entry in nodes_ext if isinstance(nodes_ext, list) else ():
        services = entry.get("services") if isinstance(entry, dict) else None
        if not isinstance(services, dict):
            continue
        host, kv, tls = entry.get("hostname"), services.get("kv"), services.get("kvSSL")
        if isinstance(host, str) and isinstance(kv, int) and isinstance(tls, int):
            found[f"{host}:{kv}"] = tls
    return found
