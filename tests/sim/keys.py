"""The metadata store's keys, as cluster/metadata.py lays them out (one cluster)."""

from __future__ import annotations

MAP = "map"
LEADER = "leader"
NODES = "nodes/"
STATUS = "status/"
IN_SYNC = "insync/"


def node(name: str) -> str:
    return NODES + name


def status(name: str) -> str:
    return STATUS + name


def in_sync(vb: int) -> str:
    return f"{IN_SYNC}{vb}"


# The map's activations (cluster/metadata.py stores them in the map's document; here a key of
# their own written in the map's transaction) and the per-vbucket failover requests.
ACTIVATIONS = "activations"
VB_FAILOVER = "vbfailover/"


def vb_failover(vb: int) -> str:
    return f"{VB_FAILOVER}{vb}"
