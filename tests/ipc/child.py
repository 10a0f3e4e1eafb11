"""A provider or reader in its own process, for the multi-process tests (tests/ipc).

Run as ``python tests/ipc/child.py <role> --dir D --service S ...``; it prints one JSON object
per line on stdout (``{"event": ...}``) and flushes each, so the test follows it. ``--crash-at
POINT`` (with ``--crash-after N``: the N-th time) makes the process SIGKILL itself at that
crash point (``changefeed.ipc.txlog.crash_point``): a kill -9 at an exact step.

Roles:
  provider  offer and publish a batch every ``--interval`` s: rows of vbucket 0 whose seqnos
            continue from where the ring ends (so readers can check there is no gap)
  reader    subscribe and read, checking every batch follows the one before (seq and seqno);
            with ``--hold N`` take N batches, report them and sleep (to be killed)
  register  subscribe at wall-clock time ``--at``, report the log index, wait for SIGTERM
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np
import pyarrow as pa

from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA
from changefeed.ipc import Geometry, IpcError, LostDataError, subscribe, txlog
from changefeed.ipc.provider import Provider

stop = False


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def on_term(signum: int, frame: object) -> None:
    global stop
    stop = True


def arm_crash(point: str | None, after: int) -> None:
    if not point:
        return
    hits = 0

    def hook(name: str, log: int, slot: int) -> None:
        nonlocal hits
        if name == point:
            hits += 1
            if hits >= after:
                emit("crashing", point=name, log=log, slot=slot)
                os.kill(os.getpid(), signal.SIGKILL)

    txlog.crash_point = hook


def rows_batch(first: int, count: int, value_bytes: int) -> pa.RecordBatch:
    seqnos = np.arange(first, first + count, dtype=np.int64)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(np.zeros(count, np.int32)),
            pa.array(seqnos),
            pa.array([f"k{s}" for s in seqnos.tolist()], pa.string()),
            pa.array([b"v" * value_bytes] * count, pa.binary()),
            pa.array(["mutation"] * count, pa.string()),
            pa.array(seqnos),
            pa.array(np.zeros(count, np.int32)),
            pa.array(np.zeros(count, np.int32)),
            pa.array(np.ones(count, np.int64)),
            pa.array(np.full(count, first, np.int64)),
            pa.array(np.full(count, first + count - 1, np.int64)),
        ],
        schema=CHANGE_ROW_SCHEMA,
    )


def positions_for(group: tuple[int, ...], first: int, last: int) -> np.ndarray:
    positions = np.zeros((len(group), 5), np.uint64)
    positions[0] = (1, last, first, last, first - 1)
    return positions


def run_provider(args: argparse.Namespace) -> None:
    group = tuple(int(vb) for vb in args.group.split(","))
    geometry = Geometry(args.slots, args.slot_bytes, args.subscribers, group)
    try:
        provider = Provider.offer(args.service, geometry, directory=args.dir, bucket="default")
    except IpcError as error:
        emit("refused", error=type(error).__name__, message=str(error))
        return
    resume = provider.resume_positions()
    seqno = int(resume[0, 1]) if resume is not None else 0
    report = provider.report
    emit(
        "offered",
        reused=report.reused,
        cleaned=report.cleaned_in_writing,
        head=report.head_seq,
        seqno=seqno,
        pid=os.getpid(),
    )
    arm_crash(args.crash_at, args.crash_after)
    published = 0
    while not stop and (args.count == 0 or published < args.count):
        provider.handle_control()
        batch = rows_batch(seqno + 1, args.rows, args.value_bytes)
        seq = provider.publish(batch, positions_for(group, seqno + 1, seqno + args.rows))
        seqno += args.rows
        published += 1
        if published % 50 == 0:
            emit("published", seq=seq, seqno=seqno)
        time.sleep(args.interval)
    emit("stopping", seq=provider.head_seq, seqno=seqno, handled=provider.stats["outdated_pids"])
    emit("stopped", removed=provider.stop_offer())


def run_reader(args: argparse.Namespace) -> None:
    arm_crash(args.crash_at, args.crash_after)
    try:
        sub = subscribe(
            args.service,
            directory=args.dir,
            app_id=args.app,
            max_samples=args.max_samples,
            start=args.start,
        )
    except IpcError as error:
        emit("refused", error=type(error).__name__, message=str(error))
        return
    rollback = sub.report.rollback
    emit(
        "subscribed",
        log=sub.log_index,
        next_seq=sub.next_seq,
        rolled_back=rollback.rolled_back,
        quarantined=sorted(rollback.quarantined),
        candidates=rollback.candidates,
        released=rollback.released_slots,
        marked=list(sub.report.marked),
        outdated=None if sub.report.outdated is None else sub.report.outdated.pid,
    )
    if args.hold:
        held = []
        while len(held) < args.hold:
            sample = sub.receive(5.0)
            if sample is None:
                emit("error", message="nothing to hold")
                return
            held.append(sample)
        emit("holding", slots=[s.slot for s in held], seqs=[s.seq for s in held])
        while True:
            time.sleep(1)
    last_seq = last_seqno = None
    batches = lost = gaps = 0
    while not stop:
        try:
            sample = sub.receive(0.05)
        except LostDataError as error:
            lost += 1
            emit("lost", wanted=error.wanted_seq, oldest=error.oldest_seq)
            sub.seek("oldest")
            last_seq = last_seqno = None
            continue
        if sample is None:
            continue
        with sample:
            first = sample.batch.column("seqno")[0].as_py()
            if last_seq is not None and (sample.seq != last_seq + 1 or first != last_seqno + 1):
                gaps += 1
                emit("gap", seq=sample.seq, last_seq=last_seq, first=first, last_seqno=last_seqno)
            last_seq = sample.seq
            last_seqno = sample.batch.column("seqno")[-1].as_py()
            batches += 1
            if batches % 25 == 0:
                emit("progress", seq=last_seq, seqno=last_seqno, batches=batches)
    emit("done", batches=batches, lost=lost, gaps=gaps, seq=last_seq, seqno=last_seqno)
    sub.close()
    emit("closed")


def run_register(args: argparse.Namespace) -> None:
    time.sleep(max(0.0, args.at - time.time()))
    try:
        sub = subscribe(args.service, directory=args.dir, app_id=args.app, max_samples=1)
    except IpcError as error:
        emit("refused", error=type(error).__name__, message=str(error))
        return
    emit("registered", log=sub.log_index, pid=os.getpid())
    while not stop:
        time.sleep(0.02)
    sub.close()
    emit("closed")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["provider", "reader", "register"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--service", required=True)
    parser.add_argument("--app", type=int, default=1)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--slot-bytes", type=int, default=64 * 1024)
    parser.add_argument("--subscribers", type=int, default=6)
    parser.add_argument("--group", default="0,1")
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.002)
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--max-samples", type=int, default=2)
    parser.add_argument("--hold", type=int, default=0)
    parser.add_argument("--start", default="next")
    parser.add_argument("--at", type=float, default=0.0)
    parser.add_argument("--crash-at")
    parser.add_argument("--crash-after", type=int, default=1)
    args = parser.parse_args()
    if args.start not in ("next", "oldest"):
        args.start = int(args.start)
    signal.signal(signal.SIGTERM, on_term)
    {"provider": run_provider, "reader": run_reader, "register": run_register}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
