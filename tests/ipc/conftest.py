"""Fixtures of the ipc tests: a private service directory, unique service names, children.

Every test's service lives in its own tmp directory under a name no other test uses; at teardown
every child still running is killed, and any shared-memory segment of the test's services that
is left is unlinked (the test itself checks what it expects to be left).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from changefeed.ipc.segments import Segment, ServicePaths
from ipc.helpers import Child

ServiceFactory = Callable[[], str]


@pytest.fixture
def ipc_dir(tmp_path: Path) -> Iterator[Path]:
    """The test's service directory; every segment of a service in it is unlinked at the end
    (the segments' names carry a hash of the directory: nodes' services are found too)."""
    path = tmp_path / "ipc"
    path.mkdir()
    yield path
    prefix = ServicePaths("x", path).control_segment.split("-x-")[0].lstrip("/")
    for leftover in Path("/dev/shm").glob(f"{prefix}-*"):
        Segment.unlink("/" + leftover.name)


@pytest.fixture
def service_name(ipc_dir: Path) -> Iterator[ServiceFactory]:
    made: list[str] = []

    def make() -> str:
        name = f"t{uuid.uuid4().hex[:12]}"
        made.append(name)
        return name

    yield make
    for name in made:
        paths = ServicePaths(name, ipc_dir)
        Segment.unlink(paths.control_segment)
        Segment.unlink(paths.data_segment)


@pytest.fixture
def service(service_name: ServiceFactory) -> str:
    return service_name()


@pytest.fixture
def children() -> Iterator[Callable[..., Child]]:
    started: list[Child] = []

    def start(*args: str) -> Child:
        child = Child(*args)
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()
