"""The test hosts' network on its own: hosts reach each other through the router, and each
fault drops exactly what it says (UDP datagrams, so each direction is seen on its own)."""

from __future__ import annotations

import socket

import pytest

from support.hosts import Host, Network, in_netns, leftovers

pytestmark = pytest.mark.timeout(60)

PORT = 9999


def udp_socket(host: Host) -> socket.socket:
    """A UDP socket bound in ``host``'s namespace (a socket stays in the namespace it was made
    in, whichever thread uses it later)."""

    def make() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((host.address, PORT))
        sock.settimeout(0.3)
        return sock

    return in_netns(host.netns, make)


def delivered(sender: socket.socket, receiver: socket.socket, target: Host) -> bool:
    """Whether a datagram from ``sender`` to ``target`` reaches ``receiver`` (three tries)."""
    for attempt in range(3):
        sender.sendto(b"ping %d" % attempt, (target.address, PORT))
        try:
            receiver.recvfrom(64)
            return True
        except TimeoutError:
            continue
    return False


def test_faults_drop_exactly_what_they_say() -> None:
    with Network() as network:
        a, b, c = (network.add_host(name) for name in "abc")
        sa, sb, sc = udp_socket(a), udp_socket(b), udp_socket(c)
        try:
            assert delivered(sa, sb, b) and delivered(sb, sa, a)

            network.block([a], [b])  # one way: a's packets to b only
            assert not delivered(sa, sb, b)
            assert delivered(sb, sa, a)
            assert delivered(sa, sc, c)

            network.heal()
            assert delivered(sa, sb, b)

            network.isolate(c)
            assert not delivered(sa, sc, c) and not delivered(sc, sa, a)
            assert delivered(sa, sb, b) and delivered(sb, sa, a)

            network.heal()
            network.partition([a], [b, c])
            assert not delivered(sa, sb, b) and not delivered(sc, sa, a)
            assert delivered(sb, sc, c) and delivered(sc, sb, b)
            assert network.drops  # the rules are there

            network.heal()
            assert not network.drops
            assert delivered(sa, sc, c) and delivered(sc, sa, a)
        finally:
            for sock in (sa, sb, sc):
                sock.close()
        prefix = network.prefix
    assert leftovers(prefix) == []
