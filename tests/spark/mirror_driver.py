"""A Spark driver for the kill tests: one availableNow run of the streaming mirror query.

    python mirror_driver.py --cluster HOST:PORT --tables DIR --checkpoint DIR
        [--max-offsets N] [--fail-on-data-loss false] [--master URL] [--events FILE]
        [--hold-batch B --hold-at before-commit|between-commits --hold-file FILE]

It builds a local session (``changefeed.spark.session.local_session``), runs
``readStream.format("changefeed") -> foreachBatch(MirrorWriter)`` with a checkpoint, and exits 0
once the query has processed everything available at its start.

``--writer`` picks the mirror writer (default: the distributed one). ``--hold-batch`` makes
micro-batch B stop at a chosen point, after writing ``--hold-file``, so a
test can SIGKILL the whole process group exactly there:
- ``before-commit``: inside foreachBatch, the batch's rows already read, no table committed;
- ``between-commits``: the changelog committed, the mirror not.
``--events`` gets one JSON line per batch start and end (``{"batch": B, "event": "start"}``,
``{"batch": B, "event": "end", "rows": N}``), flushed at once, so a replayed batch shows up as
two starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from changefeed.spark import MirrorWriter
from changefeed.spark.dist_mirror import DistributedMirrorWriter
from changefeed.spark.mirror import APP_ID

HOLD_S = 600.0  # the test kills us long before


class HoldingDistributedWriter(DistributedMirrorWriter):
    """The distributed writer with the same hold points: ``before-commit`` once the tasks have
    written the batch's files, before the changelog's commit; ``between-commits`` before the
    mirror's."""

    def __init__(self, path: str, options: dict[str, str], args: argparse.Namespace) -> None:
        super().__init__(path, options, APP_ID, merge_schema=False)
        self.args = args
        self.holder = HoldingMirrorWriter(path, options, args)  # its hold and event helpers

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        self.holder._event({"batch": batch_id, "event": "start"})
        super().__call__(batch_df, batch_id)
        self.holder._event({"batch": batch_id, "event": "end", "rows": self.rows_written})

    def _commit(self, table: Any, uri: str, name: str, actions: pa.Table, *rest: Any) -> None:
        batch_id = rest[1]
        point = "before-commit" if name == "changelog" else "between-commits"
        if self.holder._holding(batch_id, point):
            self.holder._hold()
        super()._commit(table, uri, name, actions, *rest)


class HoldingMirrorWriter(MirrorWriter):
    def __init__(self, path: str, options: dict[str, str], args: argparse.Namespace) -> None:
        super().__init__(path, options)
        self.args = args

    def write(self, changes: pa.Table, batch_id: int) -> None:
        self._event({"batch": batch_id, "event": "start", "rows": changes.num_rows})
        if self._holding(batch_id, "before-commit"):
            self._hold()
        super().write(changes, batch_id)
        self._event({"batch": batch_id, "event": "end", "rows": changes.num_rows})

    def _apply_mirror(self, changes: pa.Table, batch_id: int) -> None:
        if self._holding(batch_id, "between-commits"):
            self._hold()
        super()._apply_mirror(changes, batch_id)

    def _holding(self, batch_id: int, point: str) -> bool:
        return bool(batch_id == self.args.hold_batch and self.args.hold_at == point)

    def _hold(self) -> None:
        Path(self.args.hold_file).write_text(str(os.getpid()))
        time.sleep(HOLD_S)
        raise SystemExit("held for too long: nobody killed the driver")

    def _event(self, event: dict[str, Any]) -> None:
        if self.args.events:
            with open(self.args.events, "a") as handle:
                handle.write(json.dumps(event) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--tables", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--max-offsets", type=int, default=0)
    parser.add_argument("--fail-on-data-loss", default="true")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--events", default="")
    parser.add_argument("--hold-batch", type=int, default=-1)
    parser.add_argument("--hold-at", choices=["before-commit", "between-commits"])
    parser.add_argument("--hold-file", default="")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--writer", choices=["distributed", "local"], default="distributed")
    args = parser.parse_args()
    assert args.hold_batch < 0 or (args.hold_at and args.hold_file), "hold needs --hold-at/-file"

    from changefeed.spark.session import local_session

    spark = local_session("changefeed-mirror-driver", master=args.master)
    # The workload's values are not JSON: the documents stay bytes (and are compared as such).
    options = {
        "cluster": args.cluster,
        "failOnDataLoss": args.fail_on_data_loss,
        "format": "binary",
    }
    if args.max_offsets:
        options["maxOffsetsPerTrigger"] = str(args.max_offsets)
    holding = HoldingDistributedWriter if args.writer == "distributed" else HoldingMirrorWriter
    writer = holding(args.tables, options, args)
    query = (
        spark.readStream.format("changefeed")
        .options(**options)
        .load()
        .writeStream.foreachBatch(writer)
        .option("checkpointLocation", args.checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    finished = query.awaitTermination(args.timeout_s)
    if not finished:
        query.stop()
        print(f"query did not finish in {args.timeout_s} s", file=sys.stderr)
        return 2
    if query.exception() is not None:
        print(f"query failed: {query.exception()}", file=sys.stderr)
        return 1
    rows = [p["numInputRows"] for p in query.recentProgress]
    print(json.dumps({"rows_per_batch": rows}))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
