"""A real etcd on loopback for the cluster tests: one per test module, always stopped.

``etcd`` (module scope) is a running ``EtcdServer`` (``changefeed.cluster.etcd_server``, the
launcher ``changefeed cluster start`` uses too) on free ports with its data under the module's
temporary directory. Tests sharing it keep apart by cluster name: ``cluster_name`` gives each
test its own. ``running_etcd`` is the same as a context manager, for a test that needs an etcd
of its own (to stop and restart it).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.cluster.etcd_server import EtcdServer

_names = itertools.count(1)


@contextlib.contextmanager
def running_etcd(workdir: Path) -> Iterator[EtcdServer]:
    """Start an etcd with its data under ``workdir``; stop it (SIGTERM, then SIGKILL) on exit,
    printing its log tail."""
    server = EtcdServer(workdir / "etcd")
    try:
        yield server.start()
    finally:
        server.stop()
        print(f"--- etcd log tail ---\n{server.log_tail()}")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def cluster_name(request: pytest.FixtureRequest) -> str:
    """A cluster name of this test's own (tests of a module share one etcd)."""
    return f"t{next(_names)}-{request.node.name[:40]}".replace("[", "-").replace("]", "")
