"""The stream state machine: its table, the first marker, snapshot ends and the end seqno."""

from __future__ import annotations

import itertools

import pytest

from changefeed.checkpoint import MARKER_FLAG_DISK, MARKER_FLAG_MEMORY, SnapshotStart
from changefeed.producer.stream_machine import (
    TRANSITIONS,
    StreamInput,
    StreamMachine,
    StreamState,
)
from changefeed.protocol.dcp import StreamEndReason

FOREVER = 2**64 - 1


def test_ended_is_final_and_ending_only_sends_the_end() -> None:
    for (state, what), following in TRANSITIONS.items():
        if state is StreamState.ENDED:
            assert what is StreamInput.CLOSE
            assert following is StreamState.ENDED
        if state is StreamState.ENDING:
            assert what in (StreamInput.END_SENT, StreamInput.CLOSE)


def test_every_pair_outside_the_table_is_refused() -> None:
    for state, what in itertools.product(StreamState, StreamInput):
        if (state, what) in TRANSITIONS:
            continue
        machine = StreamMachine(0, FOREVER)
        machine.state = state
        with pytest.raises(AssertionError):
            machine._apply(what)


def test_first_marker_starts_at_the_start_seqno_then_markers_are_as_read() -> None:
    machine = StreamMachine(5, FOREVER)
    first = machine.marker(SnapshotStart(1, 10, MARKER_FLAG_DISK))
    assert first == SnapshotStart(5, 10, MARKER_FLAG_DISK)
    assert machine.state is StreamState.IN_DISK_SNAPSHOT
    machine.item(7)
    machine.item(10)
    assert machine.state is StreamState.SNAPSHOT_PENDING
    second = machine.marker(SnapshotStart(11, 12, MARKER_FLAG_MEMORY))
    assert second == SnapshotStart(11, 12, MARKER_FLAG_MEMORY)
    assert machine.state is StreamState.IN_MEMORY_SNAPSHOT  # the switch from disk to memory


def test_the_stream_ends_after_the_whole_snapshot_holding_end_seqno() -> None:
    machine = StreamMachine(0, 3)
    machine.marker(SnapshotStart(1, 5, MARKER_FLAG_MEMORY))
    for seqno in (1, 3, 4):
        machine.item(seqno)
        assert machine.live
    machine.item(5)
    assert machine.state is StreamState.ENDING
    assert machine.end_sent() is StreamEndReason.OK
    assert machine.state is StreamState.ENDED


def test_a_marker_past_the_end_ends_the_stream_without_being_sent() -> None:
    machine = StreamMachine(0, 3)
    machine.marker(SnapshotStart(1, 3, MARKER_FLAG_MEMORY))
    machine.item(2)  # seqno 3 was deduplicated away: the snapshot never reached its end item
    assert machine.marker(SnapshotStart(4, 6, MARKER_FLAG_MEMORY)) is None
    assert machine.end_reason is StreamEndReason.OK


def test_nothing_to_send_ends_at_once_and_the_first_reason_wins() -> None:
    machine = StreamMachine(9, 9)
    assert machine.state is StreamState.ENDING
    machine.end(StreamEndReason.CLOSED)
    assert machine.end_sent() is StreamEndReason.OK


def test_items_must_increase_and_stay_inside_the_snapshot() -> None:
    machine = StreamMachine(0, FOREVER)
    machine.marker(SnapshotStart(1, 4, MARKER_FLAG_MEMORY))
    machine.item(2)
    with pytest.raises(AssertionError):
        machine.item(2)
    with pytest.raises(AssertionError):
        machine.item(5)
