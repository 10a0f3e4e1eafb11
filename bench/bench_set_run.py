"""CPU per SET of `Bucket.set_run` in process, the node's part of a window of plain SETs
without the socket, the event loop or the flusher's commits: runs of `--window` new keys over
64 vbuckets (a small window touches most vbuckets once, so what a run pays per vbucket is paid
per SET), every vbucket flushed every 64 runs outside the clock. Run two trees alternately
with PYTHONPATH to compare them.

    .venv/bin/python bench/bench_set_run.py --window 16 --items 64000
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

from changefeed.protocol.set_run import SetRun
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.vbmap import vbucket_for_key

VBUCKETS = 64


def runs_of(window: int, items: int) -> list[SetRun]:
    runs = []
    for first in range(0, items, window):
        keys = [b"key%012d" % n for n in range(first, min(first + window, items))]
        count = len(keys)
        zeros = [0] * count
        runs.append(
            SetRun(
                [vbucket_for_key(key, VBUCKETS) for key in keys],
                list(range(count)),
                keys,
                [b"v" * 100] * count,
                zeros,
                zeros,
                zeros,
                checked=True,
            )
        )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--items", type=int, default=64_000)
    args = parser.parse_args()
    runs = runs_of(args.window, args.items)
    with tempfile.TemporaryDirectory() as tmp:
        config = NodeConfig(data_dir=Path(tmp), vbuckets=VBUCKETS, durable=False)
        bucket = Bucket.open(config, rng=random.Random(1))
        cpu_s = 0.0
        try:
            for number, run in enumerate(runs):
                started = time.process_time()
                answers = bucket.set_run(run)
                cpu_s += time.process_time() - started
                assert not answers.errors, answers.errors
                if number % 64 == 63:
                    for vbucket in bucket.vbuckets.values():
                        vbucket.flush()
        finally:
            for vbucket in bucket.vbuckets.values():
                vbucket.close()
            bucket.store.close()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"set_run window {args.window}: {1e6 * cpu_s / args.items:.2f} us/SET "
          f"({args.items:,} SETs; load {load})")  # fmt: skip


if __name__ == "__main__":
    main()
