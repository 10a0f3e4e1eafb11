"""The ``changefeed`` source in Spark Declarative Pipelines (``spark-pipelines``, Spark 4.3),
as a team using them would write it (issue 30 item 4).

Both are slow (a ``spark-pipelines`` run starts its own Spark Connect server: 40-75 s here).

- A streaming table fed by the source: ``spark-pipelines run`` reads every vbucket to its high
  seqno (the run's available-now trigger) and the table's newest row of each key equals the
  store, every column.
- An AUTO CDC flow (``create_auto_cdc_flow``) with the source as its source is accepted up
  to the target's table format: open-source Spark refuses a target whose connector cannot MERGE
  (parquet), and the connectors that can (Delta, Iceberg) are JVM packages from Maven, which
  this machine cannot reach. The test names that refusal, so it fails the day it runs.

``spark-pipelines`` ends a run that read a Python data source (any: a ten-line one
does too) with an ``UNKNOWN_RESPONSE`` traceback from its Spark Connect client, after "Run is
COMPLETED"; the tests read the run's events, not its exit status.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from changefeed.cli.node_process import NodeProcess
from changefeed.spark.session import CONF_DIR
from support.nodes import NodeFactory

from .helpers import Doc, diff, store_state, write
from .standalone import SPARK_HOME

pytestmark = pytest.mark.timeout(300)

RUN_TIMEOUT_S = 240.0
SPARK_PIPELINES = Path(sys.executable).parent / "spark-pipelines"

SOURCE = """
from pyspark import pipelines as dp
from pyspark.sql import SparkSession, functions as F

from changefeed.spark import register

spark = SparkSession.active()
register(spark)


@dp.{kind}
def changes():
    return (spark.readStream.format("changefeed").option("cluster", {{cluster!r}})
            .option("format", "binary").load())
"""

TABLE_FLOW = SOURCE.format(kind="table")  # a streaming table of the changes

AUTO_CDC_FLOW = (
    SOURCE.format(kind="temporary_view")
    + """

dp.create_streaming_table("documents")
dp.create_auto_cdc_flow(
    target="documents", source="changes", keys=["key"], sequence_by=F.col("seqno"),
    apply_as_deletes=F.expr("op = 'deletion'"), except_column_list=["op"],
)
"""
)


def pipeline(tmp_path: Path, flow: str, node: NodeProcess) -> subprocess.CompletedProcess[str]:
    """Run a one-file pipeline project with ``spark-pipelines run``; its tables go under
    ``tmp_path/project/spark-warehouse`` (the warehouse is a static setting: a pipeline's
    configuration cannot move it)."""
    project = tmp_path / "project"
    (project / "transformations").mkdir(parents=True)
    (project / "transformations" / "flow.py").write_text(flow.format(cluster=node.address))
    spec = {
        "name": "changefeed_test",
        "storage": (tmp_path / "storage").as_uri(),
        "libraries": [{"glob": {"include": "transformations/**"}}],
    }
    (project / "spark-pipeline.yml").write_text(json.dumps(spec))  # YAML is a JSON superset
    env = {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_CONF_DIR": str(CONF_DIR),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    return subprocess.run(
        [str(SPARK_PIPELINES), "run"], cwd=project, env=env, capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def documents(node: NodeProcess, rng: random.Random, count: int) -> None:
    write(node.port, [(f"d{i:04d}", json.dumps({"i": i, "x": rng.random()}).encode())
                      for i in range(count)])  # fmt: skip
    write(node.port, [(f"d{rng.randrange(count):04d}", None) for _ in range(count // 10)])
    write(node.port, [(f"d{rng.randrange(count):04d}", b'{"again": true}')
                      for _ in range(count // 10)])  # fmt: skip


@pytest.mark.slow
def test_a_pipeline_table_fed_by_the_source_equals_the_store(
    nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    node = nodes(args=["--no-durable"])
    documents(node, rng, 1200)
    done = pipeline(tmp_path, TABLE_FLOW, node)
    output = done.stdout + done.stderr
    assert "Run is COMPLETED" in output, output[-4000:]
    table = pq.read_table(tmp_path / "project" / "spark-warehouse" / "changes")
    table = table.sort_by([("vbucket", "ascending"), ("seqno", "ascending")])
    newest: dict[str, dict[str, object]] = {}
    for row in table.to_pylist():  # in stream order per vbucket: the last row of a key wins
        newest[row["key"]] = row
    got = {
        key: Doc(r["vbucket"], r["seqno"], r["value"], r["cas"], r["flags"], r["expiry"],
                 r["rev_seqno"])
        for key, r in newest.items()
        if r["op"] == "mutation"
    }  # fmt: skip
    assert not diff(got, store_state(node)), diff(got, store_state(node))
    deleted = {key for key, r in newest.items() if r["op"] == "deletion"}
    assert deleted and not deleted & set(got)
    assert pc.all(pc.is_in(table["op"], pc.cast(["mutation", "deletion"], "string"))).as_py()


@pytest.mark.slow
def test_auto_cdc_takes_the_source_and_needs_a_target_that_can_merge(
    nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    node = nodes(args=["--no-durable"])
    documents(node, rng, 200)
    done = pipeline(tmp_path, AUTO_CDC_FLOW, node)
    output = done.stdout + done.stderr
    assert "AUTOCDC_TARGET_DOES_NOT_SUPPORT_MERGE" in output, output[-4000:]
    assert "(format: parquet)" in output, output[-4000:]
