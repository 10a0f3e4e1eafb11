"""``support.netns.own_network``, which gives each pytest-xdist worker a network of its own: a
port bound inside is not bound outside, and the loopback inside works, also on a machine
without iproute2 (a PATH with no ``ip``: the loopback is brought up by ioctl)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parents[1]
# In a process of its own (the namespace cannot be left): listen on 127.0.0.1, connect to
# itself through the new loopback, print the port, and hold it until stdin closes.
CHILD = """
import socket, sys
from support.netns import own_network
assert own_network()
server = socket.create_server(("127.0.0.1", 0))
port = server.getsockname()[1]
socket.create_connection(("127.0.0.1", port), timeout=10).close()
print(port, flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="unshare(CLONE_NEWNET) needs root")
@pytest.mark.parametrize("path", ["machine", "no-iproute2"])
def test_a_port_bound_in_a_workers_network_is_free_outside_it(path: str) -> None:
    search = os.environ["PATH"] if path == "machine" else str(Path(sys.executable).parent)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(TESTS), "PATH": search},
    )  # fmt: skip
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip().isdigit(), f"child failed: exit {child.poll()}"
        port = int(line)
        # Listening inside the child's namespace, so here the port is unbound: it binds,
        # and nothing answers on it.
        with socket.create_server(("127.0.0.1", port)):
            pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
    finally:
        child.communicate(timeout=30)  # closes stdin: the child ends
    assert child.returncode == 0
