"""Fixtures of the Spark tests.

``spark`` is one local[2] session per test module (module scope: a session costs 5-7 s, the
first streaming query on it another ~8 s of Python worker start-up). ``nodes`` (node processes
that are always reaped, printing their log tail at teardown) and ``rng`` (seeded, replay with
``CHANGEFEED_TEST_SEED=<seed>``) are shared with the integration tests: ``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def spark(request: pytest.FixtureRequest) -> Iterator[Any]:
    from changefeed.spark.session import local_session

    session = local_session(f"changefeed-tests:{request.module.__name__}")
    yield session
    session.stop()
