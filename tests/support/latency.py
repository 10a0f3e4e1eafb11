"""Added latency on the test hosts (``docs/test-hosts.md``): every packet between chosen hosts
held back by a fixed delay, then forwarded, in order.

This kernel has no netem, no tc filters and no netfilter, so nothing in the kernel can delay a
packet and no NAT can steer a connection into a TCP proxy. What it has is policy routing and
TUN devices, so the proxy forwards packets instead of bytes of one connection:

* ``Delayer.open`` creates a TUN device ``dlN`` inside the router namespace (the ``TUNSETIFF``
  ioctl runs in a thread that entered it), a routing table ``T`` whose only route is ``default
  dev dlN``, and turns reverse-path filtering off there (a packet from host A written back on
  ``dlN`` has a source routed via A's veth: strict rp_filter would drop it);
* ``Network.delay`` adds ``ip rule from A to B iif vA lookup T``: A's packets to B, as they
  enter the router from A's veth, are routed into ``dlN``. The test process reads them from the
  TUN file descriptor, holds each one ``delay_s`` and writes it back; it re-enters the router
  on ``dlN``, which the rule (``iif vA``) no longer matches, and is forwarded to B as usual.

Every byte of every connection (TCP data, ACKs, handshakes) in the chosen direction is delayed,
what netem's ``delay`` does on a link; both directions double the round trip. The forwarding
loop is an asyncio loop in a thread of the test process: a packet is a read, a timer and a
write, well within the few thousand packets a second the test workloads make. Closing the
delayer closes the descriptor, which deletes the device, its routes and the table with it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import os
import struct
import threading
from typing import Any

TUNSETIFF = 0x400454CA  # <linux/if_tun.h>
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
PACKET_MAX = 65536
STOP_S = 10.0


def open_tun(name: str) -> int:
    """A TUN device ``name`` (IP packets, no packet-info header) in the calling thread's
    namespace; returns its descriptor, non-blocking. The device lives until it is closed."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Delayer:
    """One TUN device that holds every packet routed into it ``delay_s``, then writes it back.

    Args:
        fd: the TUN descriptor (``open_tun``); the delayer closes it.
        delay_s: how long each packet is held (> 0).
    """

    def __init__(self, fd: int, delay_s: float) -> None:
        if not delay_s > 0:
            raise ValueError(f"delay_s must be > 0, not {delay_s!r}")
        self.fd = fd
        self.delay_s = delay_s
        self.forwarded = 0  # packets written back: a test checks traffic really went through
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name=f"delay-{delay_s}", daemon=True)

    def __repr__(self) -> str:
        return f"Delayer({self.delay_s} s, {self.forwarded} packets)"

    def start(self) -> Delayer:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._forward())
        finally:
            self._loop.close()

    async def _forward(self) -> None:
        held: collections.deque[tuple[float, bytes]] = collections.deque()
        arrived = asyncio.Event()
        loop = asyncio.get_running_loop()

        def readable() -> None:
            while True:
                try:
                    packet = os.read(self.fd, PACKET_MAX)
                except (BlockingIOError, InterruptedError):
                    break
                if packet[:1] and packet[0] >> 4 == 4:  # not the device's own IPv6 chatter
                    held.append((loop.time() + self.delay_s, packet))
            arrived.set()

        loop.add_reader(self.fd, readable)
        try:
            while not self._stop.is_set():
                if not held:
                    arrived.clear()
                    await _first(arrived.wait(), self._stop.wait())
                    continue
                due = held[0][0]
                if due > loop.time():
                    await _first(asyncio.sleep(due - loop.time()), self._stop.wait())
                    continue
                while held and held[0][0] <= loop.time():
                    _, packet = held.popleft()
                    # Counted before the write: a test that saw the packet arrive must see it
                    # counted (the other order raced the receiver, and once lost in CI).
                    self.forwarded += 1
                    with contextlib.suppress(OSError):  # e.g. a destination gone meanwhile
                        os.write(self.fd, packet)
        finally:
            loop.remove_reader(self.fd)

    def close(self) -> None:
        """Stop forwarding (packets still held are dropped) and close the device."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(STOP_S)
            assert not self._thread.is_alive(), f"{self!r} did not stop in {STOP_S} s"
        os.close(self.fd)


async def _first(*waits: Any) -> None:
    """Wait until the first of ``waits`` (coroutines) is done; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
