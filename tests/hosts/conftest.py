"""Fixtures of the test-host tests (``docs/test-hosts.md``): they need root (network
namespaces) and ``ip``; without them they are skipped, with the reason."""

from __future__ import annotations

import os
import shutil

import pytest


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
