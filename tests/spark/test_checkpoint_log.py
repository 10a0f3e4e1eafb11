"""Spark's offset log stays atomic with changefeed's checkpoint manager for local runs.

A local session writes its offset and commit logs through Hadoop's FileSystem API
(``session.FILE_SYSTEM_CHECKPOINTS``): each entry is written to a temporary file and renamed
into place. A driver killed with SIGKILL while writing an entry must leave the log as it was:
no entry under the new batch's name, the previous entries readable, and a query restarted on
the checkpoint runs on from there with no batch id skipped or repeated. The test writes part of
the next offset entry through the very manager Spark uses (a child JVM, which opens the entry and
writes half of it), kills the child there, and restarts a query on the checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from changefeed.spark.session import CHECKPOINT_MANAGER_KEY, FILE_SYSTEM_CHECKPOINTS

WRITER = """
import sys, time
from pyspark.java_gateway import launch_gateway
directory, name, manager = sys.argv[1:]
jvm = launch_gateway().jvm
conf = jvm.org.apache.hadoop.conf.Configuration()
conf.set("spark.sql.streaming.checkpointFileManagerClass", manager)
path = jvm.org.apache.hadoop.fs.Path(directory)
files = jvm.org.apache.spark.sql.execution.streaming.checkpointing.CheckpointFileManager.create(
    path, conf)
out = files.createAtomic(jvm.org.apache.hadoop.fs.Path(path, name), False)
out.write(bytearray(b'v1\\n{"batchWatermarkMs":0,"batchTimestampMs":'))
out.hflush()
print(files.getClass().getName(), flush=True)
time.sleep(600)  # killed long before
"""


def batch_files(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def run_until(spark: Any, checkpoint: Path, batches: int) -> Any:
    """A rate -> foreachBatch query on ``checkpoint`` stopped once ``batches`` ran."""
    query = (
        spark.readStream.format("rate").option("rowsPerSecond", 50).load()
        .writeStream.foreachBatch(lambda df, batch_id: None)
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="0 seconds").start()
    )  # fmt: skip
    deadline = time.monotonic() + 120
    try:
        while len([p for p in query.recentProgress if p["batchId"] >= 0]) < batches:
            assert query.exception() is None, query.exception()
            assert time.monotonic() < deadline, f"{batches} batches not run in 120 s"
            time.sleep(0.05)
    finally:
        query.stop()
    assert query.exception() is None, query.exception()
    return query


@pytest.mark.slow  # ~30 s and a session of its own; the default suite runs every query with it
def test_a_driver_killed_mid_write_leaves_the_offset_log_valid(spark: Any, tmp_path: Path) -> None:
    assert spark.conf.get(CHECKPOINT_MANAGER_KEY) == FILE_SYSTEM_CHECKPOINTS
    checkpoint = tmp_path / "checkpoint"
    run_until(spark, checkpoint, 3)
    offsets = checkpoint / "offsets"
    before = batch_files(offsets)
    last = before[-1]
    written = {n: (offsets / str(n)).read_bytes() for n in before}

    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(offsets), str(last + 1), FILE_SYSTEM_CHECKPOINTS],
        stdout=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        manager = child.stdout.readline().decode().strip()  # the entry is half written now
        assert manager == FILE_SYSTEM_CHECKPOINTS, manager
        temporary = [p.name for p in offsets.iterdir() if p.name.endswith(".tmp")]
        assert temporary, "the half-written entry is not in a temporary file"
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(30)

    assert batch_files(offsets) == before, "a half-written entry took a batch's name"
    assert {n: (offsets / str(n)).read_bytes() for n in before} == written
    query = run_until(spark, checkpoint, 2)
    ran = sorted({p["batchId"] for p in query.recentProgress})
    # The restart goes on from the log as it was: the last logged batch (run again if it had
    # not committed), then the next, with no id skipped.
    assert ran[0] in (last, last + 1) and ran == list(range(ran[0], ran[-1] + 1)), (last, ran)
    entry = (offsets / str(last + 1)).read_text().splitlines()
    assert entry[0] == "v1" and json.loads(entry[1])["batchTimestampMs"] > 0
    assert batch_files(checkpoint / "commits")[: last + 2] == list(range(last + 2))
