"""The node's registry of DCP connections: one entry per producer connection name.

A DCP name reused by a new connection kicks the old one (dcp-wire.md §4); STAT dcp and /metrics
read each entry's own report (`DcpProducer.stats`, `lag_items`) instead of walking connections.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from changefeed.protocol.dcp import StreamEndReason
from changefeed.server.dcp_pump import DcpPump

log = logging.getLogger("changefeed.dcp")


class DcpRegistry:
    """Live DCP pumps by connection name."""

    def __init__(self) -> None:
        self._pumps: dict[str, DcpPump] = {}
        self.streams_ended_state_changed = 0  # by end_streams: vbuckets that stopped being active

    def __len__(self) -> int:
        return len(self._pumps)

    def __iter__(self) -> Iterator[DcpPump]:
        return iter(list(self._pumps.values()))

    def register(self, pump: DcpPump) -> None:
        """Add `pump`; an older connection with the same name is disconnected."""
        old = self._pumps.get(pump.name)
        if old is not None and old is not pump:
            log.info("DCP name %r reused: closing the older connection", pump.name)
            old.disconnect()
        self._pumps[pump.name] = pump

    def unregister(self, pump: DcpPump) -> None:
        """Remove `pump` if it is still the entry for its name."""
        if self._pumps.get(pump.name) is pump:
            del self._pumps[pump.name]

    def end_streams(self, vb: int, reason: StreamEndReason) -> int:
        """End every stream of `vb` (the vbucket stopped being active here); return how many.
        Each consumer gets STREAM_END with `reason` and re-requests where the map now says."""
        ended = 0
        for pump in self:
            if pump.producer.has_stream(vb):
                pump.producer.end_stream(vb, reason)
                pump.wake()
                ended += 1
        self.streams_ended_state_changed += ended
        return ended

    def stats(self) -> Iterator[tuple[str, str]]:
        """STAT dcp: `<name>:<counter>` for every connection."""
        for pump in self:
            for counter, value in pump.producer.stats().items():
                yield f"{pump.name}:{counter}", str(value)

    def streams_total(self) -> int:
        return sum(pump.producer.stats()["streams"] for pump in self)

    def lags(self) -> Iterator[tuple[str, int, int]]:
        """(connection name, vbucket, items behind) for every stream."""
        for pump in self:
            for vb, lag in pump.producer.lag_items().items():
                yield pump.name, vb, lag
