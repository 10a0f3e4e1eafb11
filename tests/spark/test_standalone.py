"""The pipeline on a Spark standalone cluster (master + 2 workers of 1 core on loopback), where
``read`` runs in executor JVMs' Python workers and planning in the driver's runner: the mirror
equals the store, and a batch read equals it too. The slow variant takes more data and SIGKILLs
one worker (its executor and Python workers) in the middle of the query: Spark reruns the lost
tasks on the other worker.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.nodes import NodeFactory

from .helpers import (
    Model,
    assert_changelog_once,
    assert_mirror_matches,
    diff,
    store_state,
    table_state,
    workload,
)
from .helpers import write as write_ops
from .standalone import Standalone
from .test_pipeline import run_mirror

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    standalone = Standalone(tmp_path_factory.mktemp("standalone"), workers=2)
    try:
        standalone.start()
        yield standalone
    finally:
        standalone.stop()


@pytest.fixture(scope="module")
def spark(cluster: Standalone, request: pytest.FixtureRequest) -> Iterator[Any]:
    from changefeed.spark.session import local_session

    session = local_session(
        "changefeed-tests:standalone",
        master=cluster.url,
        spark_executor_memory="512m",
        spark_cores_max="2",
    )
    assert session.sparkContext.master == cluster.url
    yield session
    session.stop()


def executors(spark: Any) -> int:
    """Executors registered with the driver (the driver itself not counted)."""
    return int(spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()) - 1


def test_pipeline_on_a_standalone_cluster(
    spark: Any, cluster: Standalone, nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    node = nodes(args=["--no-durable"])
    model: Model = {}
    write_ops(node.port, workload(rng, 8000, keys=4000, delete_ratio=0.1), model)

    # The write tasks, not the driver, write these small batches: that is what runs here.
    progress = run_mirror(spark, node, tmp_path, maxOffsetsPerTrigger="4000", partitions="4",
                          mirrorDriverBatchMax="0")  # fmt: skip
    rows = [p["numInputRows"] for p in progress]
    print(f"rows per batch {rows}")
    assert len(rows) >= 2, rows
    assert executors(spark) == 2, "both workers ran an executor"
    assert_mirror_matches(tmp_path / "tables", node, model)
    assert_changelog_once(tmp_path / "tables")

    options = node.source_options(partitions="4", format="binary")  # values compared as bytes
    snapshot = spark.read.format("changefeed").options(**options).load()
    problem = diff(table_state(snapshot.toArrow()), store_state(node))  # every column
    assert not problem, f"batch read differs from the store: {problem}"


@pytest.mark.slow
def test_pipeline_survives_losing_a_worker(
    spark: Any, cluster: Standalone, nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    node = nodes(args=["--no-durable"])
    model: Model = {}
    write_ops(node.port, workload(rng, 60_000, keys=30_000, delete_ratio=0.1), model)

    killed_at: list[float] = []

    def kill_later() -> None:
        time.sleep(12.0)  # the first batches take longer (Python worker start-up)
        cluster.kill_worker(1)
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_later, daemon=True)
    killer.start()
    progress = run_mirror(spark, node, tmp_path, maxOffsetsPerTrigger="6000", partitions="4",
                          mirrorDriverBatchMax="0")  # fmt: skip
    ended = time.monotonic()
    killer.join()
    print(f"rows per batch {[p['numInputRows'] for p in progress]}")
    assert killed_at, "the worker was not killed"
    assert killed_at[0] < ended, "the query ended before the worker was killed"
    assert cluster.alive_workers() == 1
    assert executors(spark) == 1, "the lost executor is gone"
    assert_mirror_matches(tmp_path / "tables", node, model)
    assert_changelog_once(tmp_path / "tables")
