"""Fixtures shared by every test directory (the ones below add their own).

``nodes`` is a factory of node processes (``support.nodes``): ``nodes(vbuckets=8, args=[...])``
returns a started ``NodeProcess`` listening on 127.0.0.1; ``nodes(start=False)`` one to start
later. At teardown every node still running gets SIGTERM by pid (SIGKILL to its process group if
it hangs), and its log tail is printed (pytest shows it for a failing test). ``rng`` prints its
seed; rerun with ``CHANGEFEED_TEST_SEED=<seed>`` to replay.

Under pytest-xdist (``./run test`` runs two workers) each worker gets a network namespace of
its own (``support.netns``: no port is shared between workers), and ``--dist loadgroup``
schedules whole modules, test hosts and Spark as one unit each (``support.xdist_scopes``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.netns import own_network
from support.nodes import NodeFactory, node_factory


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    seed = int(os.environ.get("CHANGEFEED_TEST_SEED", random.randrange(2**32)))
    print(f"\n{request.node.nodeid}: seed {seed} (CHANGEFEED_TEST_SEED={seed} to replay)")
    return random.Random(seed)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[NodeFactory]:
    with node_factory(tmp_path) as factory:
        yield factory


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (``./run test``): scopes per module, test hosts and Spark one
    scope each (``support.xdist_scopes``; xdist's own marks do not group under pytest 9.2)."""
    if config.getvalue("dist") != "loadgroup":
        return None  # xdist's own
    from support.xdist_scopes import ModuleScheduling

    return ModuleScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker, before any test opens a socket
        own_network()
