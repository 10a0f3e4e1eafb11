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
