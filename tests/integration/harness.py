"""Checks of the integration tests on top of ``tests/support`` (shared with the Spark tests).

The node launcher, clients, ``StreamedState`` (the checking consumer) and the truth readers are
in ``support``; what is here only the integration tests use: marking where a resumed stream
starts and checking it (invariant 2), comparing a streamed state with the server's or with a
writer's model, and sampling a node's RSS while a test runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from changefeed.cli.node_process import NodeProcess
from changefeed.consumer import SessionState
from support.consumer import StreamedState


def mark(state: StreamedState) -> dict[int, int]:
    """Where each vbucket's timeline ends now (to check what a resumed stream adds)."""
    return {vb: len(events) for vb, events in state.timeline.items()}


def assert_resumed_after(
    state: StreamedState, marked: dict[int, int], session: SessionState
) -> None:
    """Invariant 2 for a stream resumed from ``session``: per vbucket, either every item is after
    the session's seqno, or a rollback comes before the first item and every item follows it."""
    for vb, events in state.timeline.items():
        resumed = events[marked.get(vb, 0) :]
        floor = session.get(vb).seqno
        for kind, seqno in resumed:
            if kind == "rollback":
                assert seqno <= floor, f"vb {vb}: rollback to {seqno} above the resume point"
                floor = seqno
            else:
                assert seqno > floor, f"vb {vb}: item {seqno} not after {floor} (resumed stream)"
        rollbacks = [i for i, (kind, _) in enumerate(resumed) if kind == "rollback"]
        items = [i for i, (kind, _) in enumerate(resumed) if kind == "item"]
        if rollbacks and items:
            assert max(rollbacks) < min(items), f"vb {vb}: a rollback came after items"


def assert_same_state(got: StreamedState, want: StreamedState, *, what: str = "consumer") -> None:
    """Live keys equal on every field the stream carries (seqno, value, cas, flags, expiry,
    rev_seqno, datatype, vbucket); a key deleted on one side is absent or deleted."""
    got_live = {k: c for k, c in got.latest().items() if not c.deleted}
    want_live = {k: c for k, c in want.latest().items() if not c.deleted}
    missing = sorted(set(want_live) - set(got_live))
    extra = sorted(set(got_live) - set(want_live))
    differ = sorted(k for k in set(got_live) & set(want_live) if got_live[k] != want_live[k])
    assert not (missing or extra or differ), (
        f"{what} state differs from the server's: {len(missing)} missing (e.g. {missing[:5]}), "
        f"{len(extra)} extra (e.g. {extra[:5]}), {len(differ)} differ "
        f"(e.g. {[(got_live[k], want_live[k]) for k in differ[:3]]})"
    )


def assert_matches_model(state: StreamedState, model: dict[bytes, bytes | None]) -> None:
    """Every key of the writer's model: live with its last value, or (deleted) absent/deleted."""
    live = state.values()
    wrong = []
    for key, value in model.items():
        if value is None:
            if key in live:
                wrong.append((key, "deleted but live"))
        elif live.get(key) != value:
            wrong.append((key, "missing" if key not in live else "stale value"))
    assert not wrong, f"{len(wrong)} keys differ from the model, e.g. {wrong[:5]}"
    unknown = set(live) - set(model)
    assert not unknown, f"keys never written: {sorted(unknown)[:5]}"


@contextlib.asynccontextmanager
async def rss_sampler(node: NodeProcess, period_s: float = 0.05) -> Any:
    """Sample the node's VmRSS in the background; yields a list that ends up holding samples."""
    samples: list[int] = []

    async def sample() -> None:
        while True:  # until cancelled
            with contextlib.suppress(OSError, KeyError):
                samples.append(node.rss_bytes())
            await asyncio.sleep(period_s)

    task = asyncio.get_running_loop().create_task(sample())
    try:
        yield samples
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
