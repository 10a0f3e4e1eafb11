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
