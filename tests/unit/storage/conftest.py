"""Fixtures for storage tests: a fresh store in a temporary directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.storage import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A store (durable=False: fast; kill -9 safety is the chaos tests' job) with vbs 0..3."""
    with Store(tmp_path / "store", durable=False) as opened:
        with opened.write_batch() as batch:
            for vb in range(4):
                batch.set_vbucket_meta(vb, state="active", failover_log=[(1000 + vb, 0)])
        yield opened
        if not opened._closed:
            opened._check_invariants()
