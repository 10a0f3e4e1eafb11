"""The cluster layer: metadata on etcd, the orchestrator, vbucket placement, a local etcd.

Sits above the server (a node joins a cluster through it) and below the CLI. Modules:

* ``metadata``: ``ClusterMetadata``, membership by leases, the map with compare-and-swap and
  fencing, the orchestrator's election.
* ``placement``: the initial map of a new cluster (sans-IO).
* ``orchestrator``: the elected map writer.
* ``etcd_server``: start and stop a loopback etcd (``changefeed cluster start``, tests).
"""

from changefeed.cluster.etcd_server import EtcdServer, etcd_binary
from changefeed.cluster.metadata import (
    ClusterMetadata,
    Leadership,
    Membership,
    MetadataUnavailableError,
)
from changefeed.cluster.orchestrator import Orchestrator
from changefeed.cluster.placement import initial_map

__all__ = [
    "ClusterMetadata",
    "EtcdServer",
    "Leadership",
    "Membership",
    "MetadataUnavailableError",
    "Orchestrator",
    "etcd_binary",
    "initial_map",
]
