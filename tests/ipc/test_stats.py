"""A service's figures (issue 27, item 4): slots by state, readers attached / stalled / behind /
dead / reclaimed, batches and rows published, the oldest unread batch's age, bytes mapped — as
the provider serves them (STAT shm, /metrics) and as any process on the host reads them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from changefeed.ipc import Geometry
from changefeed.ipc.provider import RECLAIM_BOUND_S
from changefeed.ipc.stats import FIGURES, STALLED_AGE_S, inspect
from ipc.child import positions_for, rows_batch
from ipc.test_crash import Publisher, Spawn, progress_after, reader
from ipc.test_reclaim import wait_until

GEOMETRY = Geometry(slot_count=16, slot_bytes=64 * 1024, max_subscribers=6, group=(0, 1))


def test_the_figures_follow_readers_through_stall_behind_and_death(
    service: str, ipc_dir: Path, children: Spawn
) -> None:
    pub = Publisher(service, ipc_dir, reclaim=True, geometry=GEOMETRY)
    try:
        provider = pub.provider
        empty = provider.service_stats()
        assert set(FIGURES) <= set(empty)
        assert empty["bytes_mapped"] == provider.layout.control_bytes + GEOMETRY.data_bytes
        live = reader(children, ipc_dir, service, 1)
        live.wait_for("subscribed")
        holder = reader(children, ipc_dir, service, 2, "--hold", "2")
        held = holder.wait_for("holding")["seqs"]
        wait_until(lambda: provider.head_seq > max(held) + 2 * GEOMETRY.slot_count, 30.0)
        progress_after(live, 0)
        # The holder stays behind; the live reader may be too for a moment when the machine
        # is loaded (the publisher does not wait for it), until it seeks the oldest batch.
        deadline = time.monotonic() + 30
        while (figures := provider.service_stats())["readers_behind"] != 1:
            assert time.monotonic() < deadline, figures
            time.sleep(0.01)
        slots = [figures[f"slots_{s}"] for s in ("empty", "in_writing", "ready", "referenced")]
        assert sum(slots) == GEOMETRY.slot_count
        assert figures["slots_referenced"] >= 2  # the holder's two
        assert figures["readers_attached"] == 2
        assert figures["readers_behind"] == 1  # the holder: the ring went past its next batch
        assert figures["batches_published_total"] >= figures["head_seq"] > 25
        assert figures["rows_published_total"] == 20 * figures["batches_published_total"]
        # stalled: publishing pauses, the live reader is stopped, one batch waits for it
        pub._pause.set()
        time.sleep(0.05)
        os.kill(live.pid, signal.SIGSTOP)
        try:
            time.sleep(0.05)
            first = pub.seqno + 1
            provider.publish(rows_batch(first, 20, 50), positions_for((0, 1), first, first + 19))
            pub.seqno += 20
            assert provider.service_stats()["readers_stalled"] == 0
            time.sleep(STALLED_AGE_S + 0.2)
            figures = provider.service_stats()
            assert figures["readers_stalled"] == 1
            assert figures["oldest_unread_age_s"] >= STALLED_AGE_S
        finally:
            os.kill(live.pid, signal.SIGCONT)
        wait_until(lambda: provider.service_stats()["readers_stalled"] == 0, 30.0)
        pub._pause.clear()
        # dead: the holder is killed for good and reclaimed
        holder.kill()
        wait_until(lambda: provider.service_stats()["readers_attached"] == 1, RECLAIM_BOUND_S)
        figures = provider.service_stats()
        assert figures["readers_reclaimed_total"] == 1
        assert figures["slots_reclaimed_total"] == 2
        assert figures["readers_dead"] == 0
        # any process on the host reads the same figures, without subscribing
        seen = inspect(service, str(ipc_dir))
        assert seen["readers_attached"] == 1 and seen["head_seq"] >= figures["head_seq"]
        printed = subprocess.run(
            [sys.executable, "-m", "changefeed.ipc.stats", service, str(ipc_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert {line.split()[0] for line in printed.splitlines()} == set(FIGURES)
        live.terminate()
    finally:
        pub.stop()
