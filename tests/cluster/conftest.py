"""Fixtures of the cluster tests: a real etcd per module (``support.etcd``)."""

from support.etcd import cluster_name, etcd

__all__ = ["cluster_name", "etcd"]
