"""Provider and proxy in one process: offer, subscribe, zero-copy reads, budgets, markers."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from changefeed.ipc import (
    Geometry,
    LostDataError,
    MaxSubscribersError,
    ProviderExistsError,
    SampleBudgetError,
    ServiceNotFoundError,
    ServiceReplacedError,
    subscribe,
)
from changefeed.ipc.layout import OFFERED, SEQ_IN_WRITING, STOPPED
from changefeed.ipc.provider import Provider
from changefeed.ipc.segments import Segment, ServicePaths
from ipc.child import positions_for, rows_batch

GROUP = (0, 1, 2)


def geometry(slots: int = 8, subscribers: int = 3) -> Geometry:
    return Geometry(slots, 64 * 1024, subscribers, GROUP)


def publish(provider: Provider, first: int, rows: int = 10) -> int:
    return provider.publish(
        rows_batch(first, rows, 100), positions_for(GROUP, first, first + rows - 1)
    )


def test_offer_creates_markers_and_segments_and_stop_removes_them(
    ipc_dir: Path, service: str
) -> None:
    paths = ServicePaths(service, ipc_dir)
    provider = Provider.offer(service, geometry(), directory=ipc_dir, bucket="b", node_port=7)
    assert paths.existence.exists() and paths.usage.exists() and paths.control_socket.exists()
    assert Segment.exists(paths.control_segment) and Segment.exists(paths.data_segment)
    assert not provider.report.reused
    assert provider.stop_offer() is True
    assert sorted(os.listdir(ipc_dir)) == []
    assert not Segment.exists(paths.control_segment) and not Segment.exists(paths.data_segment)


def test_a_second_provider_is_refused(ipc_dir: Path, service: str) -> None:
    with (
        Provider.offer(service, geometry(), directory=ipc_dir),
        pytest.raises(ProviderExistsError, match=f"pid {os.getpid()}"),
    ):
        Provider.offer(service, geometry(), directory=ipc_dir)
    with Provider.offer(service, geometry(), directory=ipc_dir):  # free again once stopped
        pass


def test_subscribe_to_a_service_never_offered(ipc_dir: Path, service: str) -> None:
    with pytest.raises(ServiceNotFoundError, match="not offered"):
        subscribe(service, directory=ipc_dir)


def test_batches_are_read_in_place_and_in_order(ipc_dir: Path, service: str) -> None:
    with (
        Provider.offer(service, geometry(), directory=ipc_dir) as provider,
        subscribe(service, directory=ipc_dir, app_id=1) as sub,
    ):
        assert sub.next_seq == 1
        for first in (1, 11, 21):
            publish(provider, first)
        mapped = sub._data  # the reader's own mapping of the data segment
        anchor = ctypes.c_char.from_buffer(mapped.buf)
        start = ctypes.addressof(anchor)
        try:
            for seq, first in ((1, 1), (2, 11), (3, 21)):
                with sub.receive(1.0) as sample:
                    assert sample.seq == seq
                    batch = sample.batch
                    assert batch.column("seqno").to_pylist() == list(range(first, first + 10))
                    # Zero copy: the value bytes lie inside the shared data segment.
                    address = batch.column("value").buffers()[2].address
                    assert start <= address < start + mapped.size
                    assert sample.positions[0, 1] == first + 9
            assert sub.receive(0.01) is None
        finally:
            del anchor, batch
        state = sub.session_state()
        assert state is not None and state.get(0).seqno == 30 and state.get(0).vb_uuid == 1


def test_oldest_is_the_start_of_the_ring_while_it_fills(ipc_dir: Path, service: str) -> None:
    with (
        Provider.offer(service, geometry(), directory=ipc_dir) as provider,
        subscribe(service, directory=ipc_dir, start="oldest") as sub,
    ):
        assert sub.oldest_seq() == 0 and sub.next_seq == 1  # empty: the next one
        for first in (1, 11, 21):
            publish(provider, first)
        assert sub.oldest_seq() == 1  # empty slots are no batches
        sub.seek("oldest")
        with sub.receive(1.0) as sample:
            assert sample.seq == 1


def test_a_reader_holds_at_most_max_samples(ipc_dir: Path, service: str) -> None:
    with (
        Provider.offer(service, geometry(), directory=ipc_dir) as provider,
        subscribe(service, directory=ipc_dir, max_samples=2) as sub,
    ):
        for first in (1, 11, 21):
            publish(provider, first)
        a, b = sub.receive(1.0), sub.receive(1.0)
        assert a is not None and b is not None
        with pytest.raises(SampleBudgetError, match="max_samples 2"):
            sub.receive(1.0)
        a.release()
        a.release()  # idempotent
        assert sub.receive(1.0) is not None


def test_max_subscribers_exceeded_is_a_clear_error(ipc_dir: Path, service: str) -> None:
    with Provider.offer(service, geometry(slots=8, subscribers=3), directory=ipc_dir) as provider:
        subs = [subscribe(service, directory=ipc_dir, app_id=i, max_samples=1) for i in range(3)]
        with pytest.raises(MaxSubscribersError, match="max_subscribers 3"):
            subscribe(service, directory=ipc_dir, app_id=9, max_samples=1)
        assert provider.subscription() == (3, 3)
        subs[0].close()
        with subscribe(service, directory=ipc_dir, app_id=9, max_samples=1):
            assert provider.subscription() == (3, 3)
        for sub in subs[1:]:
            sub.close()
        assert provider.subscription() == (0, 0)


def test_the_slot_budget_bounds_max_samples(ipc_dir: Path, service: str) -> None:
    with (
        Provider.offer(service, geometry(slots=8, subscribers=3), directory=ipc_dir),
        subscribe(service, directory=ipc_dir, max_samples=5),
        pytest.raises(MaxSubscribersError, match="budget of 5 of 7 slots"),
    ):
        subscribe(service, directory=ipc_dir, max_samples=3)


def test_a_slow_reader_loses_data_and_never_blocks_the_provider(
    ipc_dir: Path, service: str
) -> None:
    with (
        Provider.offer(service, geometry(slots=4), directory=ipc_dir) as provider,
        subscribe(service, directory=ipc_dir, app_id=1, max_samples=2) as slow,
        subscribe(service, directory=ipc_dir, app_id=2, max_samples=1) as fast,
    ):
        publish(provider, 1)
        with fast.receive(1.0) as sample:
            assert sample.seq == 1
        held = [slow.receive(1.0), slow.receive(0.0)]
        assert held[0] is not None and held[1] is None
        for i in range(1, 20):  # the provider goes on around the slot the slow reader holds
            publish(provider, 1 + 10 * i)
            with fast.receive(1.0) as sample:
                assert sample.seq == i + 1
        with pytest.raises(LostDataError) as lost:
            slow.receive(1.0)
        assert (
            lost.value.wanted_seq == 2 and lost.value.oldest_seq == 18
        )  # 17-20 in 4 slots, 1 held
        assert lost.value.session is not None and lost.value.session.get(0).seqno == 10
        assert held[0].batch.column("seqno")[0].as_py() == 1  # still intact while held
        held[0].release()
        slow.seek("oldest")
        with slow.receive(1.0) as sample:
            assert sample.seq == 18


def test_reoffer_with_a_proxy_attached_reuses_and_cleans_in_writing(
    ipc_dir: Path, service: str
) -> None:
    provider = Provider.offer(service, geometry(), directory=ipc_dir)
    sub = subscribe(service, directory=ipc_dir)
    publish(provider, 1)
    publish(provider, 11)
    with sub.receive(1.0) as sample:
        assert sample.seq == 1
    # A half-written slot, as a provider killed mid-publish leaves it.
    layout = provider.layout
    provider._a.store_u64(layout.slot_state(5), SEQ_IN_WRITING << 16)
    assert provider.stop_offer() is False  # a proxy holds the usage marker: kept
    assert sub.service_state == STOPPED
    provider = Provider.offer(service, geometry(), directory=ipc_dir)
    assert provider.report.reused and provider.report.cleaned_in_writing == 1
    assert provider.report.head_seq == 2 and sub.service_state == OFFERED
    publish(provider, 21)
    for seq in (2, 3):
        with sub.receive(1.0) as sample:
            assert sample.seq == seq
    sub.close()
    assert provider.stop_offer() is True


def test_reoffer_with_another_geometry_replaces_the_segments(ipc_dir: Path, service: str) -> None:
    provider = Provider.offer(service, geometry(slots=8), directory=ipc_dir)
    sub = subscribe(service, directory=ipc_dir)
    provider.stop_offer()
    provider = Provider.offer(service, geometry(slots=10), directory=ipc_dir)
    assert not provider.report.reused and "geometry changed" in provider.report.replaced_reason
    with pytest.raises(ServiceReplacedError):
        sub.receive(0.2)
    sub.close()
    with subscribe(service, directory=ipc_dir) as again:
        assert again.header.geometry.slot_count == 10
    provider.stop_offer()


def test_an_arrow_batch_too_large_for_a_slot_is_refused(ipc_dir: Path, service: str) -> None:
    with Provider.offer(service, geometry(), directory=ipc_dir) as provider:
        with pytest.raises(ValueError, match="does not fit a slot"):
            provider.publish(rows_batch(1, 1000, 100), positions_for(GROUP, 1, 1000))
        seq = provider.publish_gap(positions_for(GROUP, 1, 1000))
        with (
            subscribe(service, directory=ipc_dir, start=seq) as sub,
            pytest.raises(LostDataError, match="did not fit"),
        ):
            sub.receive(1.0)


def test_geometry_bounds() -> None:
    with pytest.raises(ValueError, match="slot_count"):
        Geometry(1, 64 * 1024, 1, GROUP)
    with pytest.raises(ValueError, match="needs at least 5 slots"):
        Geometry(4, 64 * 1024, 4, GROUP)
    with pytest.raises(ValueError, match="ascending"):
        Geometry(8, 64 * 1024, 2, (3, 1))
    with pytest.raises(ValueError, match="leaves"):
        Geometry(8, 16 * 1024, 2, tuple(range(1000)))


def test_positions_round_trip(ipc_dir: Path, service: str) -> None:
    with Provider.offer(service, geometry(), directory=ipc_dir) as provider:
        positions = np.arange(15, dtype=np.uint64).reshape(3, 5)
        seq = provider.publish(
            pa.RecordBatch.from_pylist([], schema=rows_batch(1, 1, 1).schema), positions
        )
        assert (provider.positions_of(seq) == positions).all()
        assert (provider.resume_positions() == positions).all()
