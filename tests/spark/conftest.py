"""Fixtures of the Spark tests.

``spark`` is one local[2] session per test module (module scope: a session costs 5-7 s, the
first streaming query on it another ~8 s of Python worker start-up). ``nodes`` starts node
processes that are always reaped, printing their log tail at teardown. ``rng`` prints its seed;
rerun with ``CHANGEFEED_TEST_SEED=<seed>`` to replay.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .helpers import Node

NodeFactory = Callable[..., Node]


@pytest.fixture(scope="module")
def spark(request: pytest.FixtureRequest) -> Iterator[Any]:
    from changefeed.spark.session import local_session

    session = local_session(f"changefeed-tests:{request.module.__name__}")
    yield session
    session.stop()


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    seed = int(os.environ.get("CHANGEFEED_TEST_SEED", random.randrange(2**32)))
    print(f"\n{request.node.nodeid}: seed {seed} (CHANGEFEED_TEST_SEED={seed} to replay)")
    return random.Random(seed)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[NodeFactory]:
    started: list[Node] = []

    def factory(*, start: bool = True, name: str | None = None, **kwargs: Any) -> Node:
        node = Node(tmp_path / (name or f"node{len(started)}"), **kwargs)
        started.append(node)
        return node.start() if start else node

    yield factory
    for node in started:
        if node.alive:
            try:
                node.stop(timeout_s=20)
            except (TimeoutError, AssertionError):
                node.kill()
        print(f"--- {node.root.name} log tail ---\n{node.log_tail(20)}")
