"""The test hosts' network on its own: hosts reach each other through the router, and each
fault drops exactly what it says (UDP datagrams, so each direction is seen on its own)."""

from __future__ import annotations

import random
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


def echo_through(client: Host, server: Host, payload: bytes) -> bytes:
    """Send ``payload`` over TCP from ``client`` to an echo server on ``server``; what comes
    back."""
    listener = in_netns(server.netns, socket.create_server, (server.address, PORT))
    listener.settimeout(10.0)
    try:
        conn = in_netns(client.netns, socket.create_connection, (server.address, PORT), 10.0)
        peer, _ = listener.accept()
        with conn, peer:
            peer.settimeout(10.0)
            conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)
            received = b""
            while chunk := peer.recv(65536):
                received += chunk
            peer.sendall(received)
            peer.shutdown(socket.SHUT_WR)
            back = b""
            while chunk := conn.recv(65536):
                back += chunk
            return back
    finally:
        listener.close()


def test_a_delay_forwards_every_packet_between_the_chosen_hosts_only() -> None:
    payload = random.Random(7).randbytes(300_000)
    with Network() as network:
        a, b, c = (network.add_host(name) for name in "abc")
        sa, sb, sc = udp_socket(a), udp_socket(b), udp_socket(c)
        try:
            network.delay([a], [b], 0.05)  # one way: a's packets to b only
            [delayer] = network.delayers
            assert delivered(sa, sb, b)
            assert delayer.forwarded == 1  # the datagram went through the delay
            assert delivered(sb, sa, a) and delivered(sa, sc, c) and delivered(sc, sb, b)
            assert delayer.forwarded == 1  # nothing else did

            network.slow(b, 0.05)  # both ways, b with everyone: a TCP stream both ways
            before = delayer.forwarded
            assert echo_through(c, b, payload) == payload
            assert delayer.forwarded - before > 2 * len(payload) // 1500  # data and ACKs

            network.heal()
            assert network.delayers == []
            forwarded = delayer.forwarded
            assert echo_through(a, b, payload) == payload
            assert delayer.forwarded == forwarded  # healed: no packet is held any more
        finally:
            for sock in (sa, sb, sc):
                sock.close()
        prefix = network.prefix
    assert leftovers(prefix) == []
