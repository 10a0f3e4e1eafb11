"""Fixtures for integration tests: node processes that are always reaped, and a seeded rng.

``nodes`` is a factory: ``nodes(vbuckets=8, args=[...])`` returns a started ``NodeProcess``. At
teardown every node still running gets SIGTERM (SIGKILL if it hangs), and its log tail is printed
(pytest shows it for a failing test). ``rng`` prints its seed; rerun with
``CHANGEFEED_TEST_SEED=<seed>`` to replay.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .harness import NodeProcess

NodeFactory = Callable[..., NodeProcess]


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    seed = int(os.environ.get("CHANGEFEED_TEST_SEED", random.randrange(2**32)))
    print(f"\n{request.node.nodeid}: seed {seed} (CHANGEFEED_TEST_SEED={seed} to replay)")
    return random.Random(seed)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[NodeFactory]:
    started: list[NodeProcess] = []

    def factory(*, start: bool = True, name: str | None = None, **kwargs: Any) -> NodeProcess:
        node = NodeProcess(tmp_path, name=name or f"node{len(started)}", **kwargs)
        started.append(node)
        return node.start() if start else node

    yield factory
    for node in started:
        if node.alive:
            try:
                node.stop(timeout_s=20)
            except TimeoutError:
                node.kill()
        print(f"--- {node.root.name} log tail ---\n{node.log_tail(30)}")
