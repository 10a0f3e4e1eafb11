"""A network namespace of its own for each pytest-xdist worker: two workers never share a port.

Nodes bind port 0 and keep that port across restarts; clients (replica feeds, the SDK, the
mirror) keep dialing a killed node's port until it returns. On one loopback shared by two
workers, a port freed by a kill could be bound by the other worker's next node or etcd, and a
client would then talk to a stranger. ``own_network`` moves the calling process into a fresh
network namespace (``unshare(CLONE_NEWNET)``; root only) with its loopback up: every node,
etcd, JVM and client the worker starts inherits it, so each worker has all of 127.0.0.0/8 and
every port to itself. The hostname resolves to 127.0.0.1 here (/etc/hosts), so Spark's driver
binds as before. Test hosts (``support.hosts``) make namespaces of their own from whichever
namespace they start in, and never touch the one they come from.

The worker's channel to the xdist controller is a pipe, which no namespace affects.
``setns``/``unshare`` apply to the calling thread only: xdist runs tests on the worker's main
thread (execnet's ``main_thread_only``), the thread that calls this from
``pytest_configure``, and threads and processes started later inherit its namespace.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import warnings

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913  # <linux/sockios.h>
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
IFREQ = struct.Struct("16sh22x")  # struct ifreq: the name, then ifr_flags in a 24-byte union
_libc = ctypes.CDLL(None, use_errno=True)


def own_network() -> bool:
    """Move this process (its calling thread) into a new network namespace, loopback up.

    Returns:
        whether it did; False (with a warning) where it may not (not root, or the kernel
        refuses): the worker then shares the machine's loopback, as before.

    Raises:
        OSError: the loopback of the new namespace could not be brought up.
    """
    if os.geteuid() != 0:
        warnings.warn(
            "xdist worker shares the loopback: unshare(CLONE_NEWNET) needs root", stacklevel=2
        )
        return False
    if _libc.unshare(CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        warnings.warn(
            f"xdist worker shares the loopback: unshare: {os.strerror(errno)}", stacklevel=2
        )
        return False
    loopback_up()
    return True


def loopback_up() -> None:
    """``ip link set lo up`` by ioctl: a fresh machine need not have iproute2 (the test-host
    tests skip without it, the rest of the suite must not depend on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        answer = fcntl.ioctl(sock, SIOCGIFFLAGS, IFREQ.pack(b"lo", 0))
        _, flags = IFREQ.unpack(answer)
        fcntl.ioctl(sock, SIOCSIFFLAGS, IFREQ.pack(b"lo", flags | IFF_UP))
