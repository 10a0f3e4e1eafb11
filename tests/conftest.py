"""Fixtures shared by every test directory (the ones below add their own).

``nodes`` is a factory of node processes (``support.nodes``): ``nodes(vbuckets=8, args=[...])``
returns a started ``NodeProcess`` listening on 127.0.0.1; ``nodes(start=False)`` one to start
later. At teardown every node still running gets SIGTERM by pid (SIGKILL to its process group if
it hangs), and its log tail is printed (pytest shows it for a failing test). ``rng`` prints its
seed; rerun with ``CHANGEFEED_TEST_SEED=<seed>`` to replay.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

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


# pytest-xdist (``./run test`` runs the suite on several workers): tests that would fight over
# the machine run in one worker each — test hosts (namespaces, several etcd members and nodes
# per test) and Spark (a JVM each). ``--dist loadgroup`` keeps a group on one worker.
_XDIST_GROUPS = {"hosts": "hosts", "chaos": "hosts", "spark": "spark"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests_dir = Path(__file__).parent
    for item in items:
        parts = Path(item.path).relative_to(tests_dir).parts
        group = _XDIST_GROUPS.get(parts[0]) if len(parts) > 1 else None
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
