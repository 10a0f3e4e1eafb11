"""Explicit memory ordering where one process publishes data another reads (issue 27, item 5).

x86 cannot show a missing fence, so these tests check that each fence of a pair is issued at
its place, through a recording wrapper around the real atomics: the provider's release fence
right after its CAS of a slot to IN_WRITING (before any store into the slot), and a reader's
acquire fence between its unreferenced copy of a slot and the load that validates it. Both
backends must provide both fences.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from changefeed.ipc import Geometry, subscribe
from changefeed.ipc.atomic import atomics_for, backends
from changefeed.ipc.layout import IN_WRITING_WORD
from changefeed.ipc.provider import Provider
from changefeed.ipc.ring import claim_slot
from ipc.child import positions_for, rows_batch

GEOMETRY = Geometry(slot_count=4, slot_bytes=64 * 1024, max_subscribers=2, group=(0, 1))


class Recording:
    """The real atomics, with every call's name (and a CAS's outcome) recorded in order."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)
        if not callable(target):
            return target

        def call(*args: int) -> Any:
            result = target(*args)
            if name.startswith("cas") and len(args) == 3:
                name_ok = f"{name}:{'won' if result == args[1] else 'lost'}:{args[2]:#x}"
                self.calls.append(name_ok)
            else:
                self.calls.append(name)
            return result

        return call


@pytest.mark.parametrize("backend", backends())
def test_both_backends_fence(backend: str) -> None:
    memory = mmap.mmap(-1, 4096)
    a = atomics_for(memoryview(memory), backend)
    try:
        a.fence_acquire()
        a.fence_release()
    finally:
        a.close()


@pytest.mark.parametrize("backend", backends())
def test_the_claim_cas_is_followed_by_a_release_fence(backend: str) -> None:
    memory = mmap.mmap(-1, 4096)
    a = atomics_for(memoryview(memory), backend)
    try:
        recording = Recording(a)
        states = [8 * i for i in range(4)]
        a.store_u64(states[1], 5 << 16 | 1)  # referenced: the claim must pass it by
        for prefer in (-1, 1, 2):
            recording.calls.clear()
            slot = claim_slot(recording, states, prefer=prefer)  # type: ignore[arg-type]
            won = [i for i, c in enumerate(recording.calls) if ":won:" in c]
            assert len(won) == 1 and recording.calls[won[0]].endswith(f"{IN_WRITING_WORD:#x}")
            assert recording.calls[won[0] + 1 :] == ["fence_release"], recording.calls
            assert a.load_u64(states[slot]) == IN_WRITING_WORD
    finally:
        a.close()


def test_a_validated_copy_fences_before_its_validating_load(service: str, ipc_dir: Path) -> None:
    provider = Provider.offer(service, GEOMETRY, directory=ipc_dir, bucket="default")
    try:
        seq = provider.publish(rows_batch(1, 5, 10), positions_for(GEOMETRY.group, 1, 5))
        with subscribe(service, directory=ipc_dir, app_id=1, max_samples=1) as sub:
            recording = Recording(sub._a)
            sub._a = recording  # type: ignore[assignment]
            try:
                positions = sub.positions_of(seq)
            finally:
                sub._a = recording._inner
            assert positions is not None and int(positions[0, 1]) == 5
            assert recording.calls[-2:] == ["fence_acquire", "load_u64"], recording.calls
            np.testing.assert_array_equal(positions, provider.positions_of(seq))
    finally:
        provider.stop_offer()
