"""The cluster map push as the SDK sees it: a node in this process (so the test can change its
map) pushes a new revision to the SDK's connections (ClustermapChangeNotification, which the
SDK negotiates by default), once per revision, and the SDK routes by it at once: a map that
gives a vbucket no active copy makes the SDK stop sending that vbucket's requests, and the
next revision, which gives it back, makes them work again."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import pytest
from couchbase.cluster import Cluster
from couchbase.exceptions import UnAmbiguousTimeoutException

from changefeed.server.config import NodeConfig
from changefeed.server.node import Node
from changefeed.vbmap import vbucket_for_key

from .conftest import SHORT_TIMEOUT, VBUCKETS, connect

T = TypeVar("T")


class ThreadedNode:
    """A node serving from an event loop on a thread of this process."""

    def __init__(self, data_dir: Path) -> None:
        config = NodeConfig(data_dir=data_dir, port=0, vbuckets=VBUCKETS, durable=False)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.node = self.call(lambda: Node(config))
        self.run(self.node.start())
        self.port = self.node.port

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the node's loop and wait for its result."""

        async def wrapped() -> T:
            return fn()

        return self.run(wrapped())

    def run(self, coroutine: object) -> T:  # type: ignore[type-var]
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)  # type: ignore[arg-type]

    def close(self) -> None:
        self.run(self.node.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def threaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedNode]:
    node = ThreadedNode(tmp_path_factory.mktemp("push"))
    try:
        yield node
    finally:
        node.close()


def test_a_pushed_map_is_applied_by_the_sdk_at_once(threaded: ThreadedNode) -> None:
    cluster: Cluster = connect(threaded, config_poll_interval=timedelta(seconds=60))
    try:
        collection = cluster.bucket("default").default_collection()
        key = "routed"
        collection.upsert(key, {"v": 1})
        other = next(
            k
            for k in (f"other-{n}" for n in range(1000))
            if vbucket_for_key(k.encode(), VBUCKETS) != vbucket_for_key(key.encode(), VBUCKETS)
        )
        collection.upsert(other, {"v": 2})
        context = threaded.node.context
        connections = threaded.call(lambda: set(context.connections))
        base = threaded.call(context.current_map)
        vb = vbucket_for_key(key.encode(), VBUCKETS)

        # Revision +1: vbucket `vb` has no active copy. The SDK stops sending to it.
        chains = tuple((-1,) if i == vb else chain for i, chain in enumerate(base.chains))
        orphaned = dataclasses.replace(base, rev=base.rev + 1, chains=chains)
        sent = threaded.call(lambda: _push(context, orphaned))
        assert sent >= 1  # every SDK connection that selected the bucket
        assert threaded.call(context.push_cluster_map) == 0  # once per revision
        # The SDK applies a pushed map on its own IO thread, so a get sent at once may still
        # race it (seen once under CI load). Its config poll is off for this test (60 s), so
        # a map applied within the wait below can only have come from the push.
        assert _refused_within(lambda: collection.get(key, timeout=SHORT_TIMEOUT), seconds=10)
        assert collection.get(other).content_as[dict] == {"v": 2}  # the rest still routes

        # Revision +2 gives it back; the SDK's connections were never closed.
        restored = dataclasses.replace(base, rev=base.rev + 2)
        assert threaded.call(lambda: _push(context, restored)) == sent
        assert collection.get(key).content_as[dict] == {"v": 1}
        assert connections <= threaded.call(lambda: set(context.connections))
    finally:
        cluster.close()


def _refused_within(get: Callable[[], object], *, seconds: float) -> bool:
    """Whether ``get`` times out (no node to send it to) before ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            get()
        except UnAmbiguousTimeoutException:
            return True
        time.sleep(0.02)
    return False


def _push(context: object, new_map: object) -> int:
    context.cluster_map = new_map  # type: ignore[attr-defined]
    return context.push_cluster_map()  # type: ignore[attr-defined, no-any-return]
