"""The ``nodes`` fixture's factory: node processes under a test's directory, always stopped.

``NodeFactory`` is the fixture's type: ``nodes(vbuckets=8, args=[...])`` returns a started
``NodeProcess`` under ``tmp_path/<name>``; ``nodes(start=False)`` one not started yet. When the
test ends every node still running gets SIGTERM by pid (SIGKILL to its process group if it
hangs or the stop fails), and its log tail is printed (pytest shows it for a failing test).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

from changefeed.cli.node_process import NodeProcess

TEST_VBUCKETS = 16  # fewer than a production node's 64: faster starts, streams and backfills
TEARDOWN_STOP_S = 20.0
TEARDOWN_LOG_LINES = 30


class NodeFactory(Protocol):
    def __call__(
        self,
        *,
        start: bool = True,
        name: str | None = None,
        vbuckets: int = TEST_VBUCKETS,
        args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> NodeProcess: ...


@contextlib.contextmanager
def node_factory(workdir: Path) -> Iterator[NodeFactory]:
    """Yield a ``NodeFactory`` making nodes under ``workdir``; stop them all on exit."""
    started: list[NodeProcess] = []

    def factory(
        *,
        start: bool = True,
        name: str | None = None,
        vbuckets: int = TEST_VBUCKETS,
        args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> NodeProcess:
        node = NodeProcess(
            workdir / (name or f"node{len(started)}"), vbuckets=vbuckets, args=args, env=env
        )
        started.append(node)  # before start: a node that fails to start is reaped too
        return node.start() if start else node

    try:
        yield factory
    finally:
        with contextlib.ExitStack() as teardown:  # every node is stopped, even if one fails
            for node in reversed(started):  # callbacks run last in, first out
                teardown.callback(stop, node)


def stop(node: NodeProcess) -> None:
    """Teardown of one node: SIGTERM by pid, SIGKILL to its group if that fails; print the
    log tail."""
    try:
        if node.alive:
            node.stop(timeout_s=TEARDOWN_STOP_S, check=False)
    except (TimeoutError, OSError) as error:  # TimeoutError: already killed
        print(f"--- {node.root.name}: stop failed: {error!r}")
    finally:
        node.kill()  # no-op unless it is still running
    print(f"--- {node.root.name} log tail ---\n{node.log_tail(TEARDOWN_LOG_LINES)}")
