"""Fixtures of the test-host tests (``docs/test-hosts.md``): they need root (network
namespaces) and ``ip``; without them they are skipped, with the reason."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from support.hosts import reap_stale


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = ""
    if os.geteuid() != 0:
        reason = "test hosts need root (network namespaces)"
    elif shutil.which("ip") is None:
        reason = "test hosts need iproute2's ip"
    if reason:
        for item in items:
            if "/hosts/" in str(item.path):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def workdir(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """Where a test's hosts keep their data and logs: ``tmp_path`` (pytest keeps the last three
    runs' only), or ``$CHANGEFEED_HOSTS_KEEP/<test name>-<pid>`` to keep them for debugging."""
    keep = os.environ.get("CHANGEFEED_HOSTS_KEEP")
    if not keep:
        return tmp_path
    # A directory of this run's own: a node or etcd member must never start on old data.
    path = Path(keep) / f"{str(request.node.name).replace('/', '_')}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    print(f"\nlogs and data under {path}")
    return path


@pytest.fixture(scope="session", autouse=True)
def _reap_stale_hosts() -> None:
    """Remove the namespaces a killed earlier run left (only those whose pid is gone)."""
    if os.geteuid() == 0 and shutil.which("ip") is not None:
        for name in reap_stale():
            print(f"removed namespace {name} of a run that is gone")
