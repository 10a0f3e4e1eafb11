"""Shared-memory fan-out of a node's change stream to local readers, with partial restart.

A node offers one *service* per stream group (a set of vbuckets): a ring of slots in shared
memory holding Arrow IPC batches of change rows (consumer/change_rows.py's schema), and a
control segment with the slots' states and reference counts, the subscription state, one
transaction log per possible reader and a UID/PID map. Readers on the same host map it and take
batches without a copy; any reader, or the node, can be killed and restarted without leaking
slots or blocking the others (LoLa's partial restart: shared/seeds/partial-restart-transaction-
logs.md). See docs/ipc.md.

    from changefeed.ipc import subscribe
    with subscribe("default-11210-g0", app_id=7) as sub:
        for sample in sub:
            with sample:
                handle(sample.batch)          # a pyarrow.RecordBatch over shared memory

`LocalStream` adds the DCP fallback: a reader that fell behind the ring resumes over DCP from
its session state and rejoins the ring.

Layers: ipc sits beside consumer/ and spark/ (it uses consumer/ and protocol/); the node's
publisher (server/shm_publisher.py) feeds it.
"""

from changefeed.ipc.errors import (
    ControlSegmentError,
    CouldNotRestartProxyError,
    IpcError,
    LostDataError,
    MaxSubscribersError,
    ProviderExistsError,
    SampleBudgetError,
    ServiceNotFoundError,
    ServiceReplacedError,
)
from changefeed.ipc.layout import Geometry
from changefeed.ipc.proxy import Sample, Subscription, positions_to_session, subscribe

__all__ = [
    "ControlSegmentError",
    "CouldNotRestartProxyError",
    "Geometry",
    "IpcError",
    "LostDataError",
    "MaxSubscribersError",
    "ProviderExistsError",
    "Sample",
    "SampleBudgetError",
    "ServiceNotFoundError",
    "ServiceReplacedError",
    "Subscription",
    "positions_to_session",
    "subscribe",
]
