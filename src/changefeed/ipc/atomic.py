"""Atomic operations on a shared-memory buffer, by byte offset.

Every cross-process word of the control segment (slot states and reference counts, the
subscription state, transaction-log owners and flags, the UID/PID map) is read and written
through one `Atomics` object per mapping. Fields sit on their natural alignment (layout.py), so
every operation is a single lock-free instruction.

Backend, chosen by measurement (bench/bench_ipc.py prints it; reference numbers in
docs/ipc.md): ``atomicshm`` (a C extension: ~35-100 ns an operation from Python) when it can be
imported, else ``ctypes`` calls into the system's ``libatomic`` (~350-480 ns). The ``atomics``
package (patomic through cffi) was measured at ~4.5-9 us an operation and needs one view object
per field, so it is not used. Both backends use sequentially consistent operations: the
transaction-log protocol relies on the order BEGIN -> operation -> END being seen by a restarted
process in that order, on every CPU (x86 would keep plain stores in order; ARM would not).

Plain memory (a slot's header, positions and Arrow payload) is ordered against these words by
fences, one pair per place where one process publishes data another reads:

* writer: `fence_release` right after the provider's CAS of a slot to IN_WRITING (ring.py
  `claim_slot`), so no store into the slot becomes visible before the slot reads IN_WRITING;
  the seq_cst store of the new state word (`commit_slot`) then publishes the finished slot.
* reader: `fence_acquire` between copying a slot's bytes without a reference and loading its
  state word again to validate the copy (proxy.py `positions_of`, stats.py: a seqlock read),
  so the copy cannot be satisfied after the validating load.

A reader holding a reference needs no fence: its reference CAS (acquire) comes before its
reads, its release (a seq_cst fetch_sub) after them, and the provider's claim CAS on the same
word can only succeed after that release.

Not here: what the words mean (layout.py, txlog.py).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Final

BACKEND_ENV: Final = "CHANGEFEED_IPC_ATOMICS"  # "atomicshm" or "libatomic"; unset: the fastest


class _SharedMemoryAtomics:
    """The atomicshm backend: one `AtomicView` over the whole buffer."""

    backend = "atomicshm"

    def __init__(self, buffer: memoryview) -> None:
        import atomicshm

        self._view: Any = atomicshm.AtomicView(buffer)
        view = self._view
        # Bound methods, looked up once: these are the hot path of every reference.
        self.load_u8 = view.load_u8
        self.store_u8 = view.store_u8
        self.load_u16 = view.load_u16
        self.load_u32 = view.load_u32
        self.store_u32 = view.store_u32
        self.cas_u32 = view.cas_u32
        self.load_u64 = view.load_u64
        self.store_u64 = view.store_u64
        self.cas_u64 = view.cas_u64
        self.fetch_add_u64 = view.fetch_add_u64
        self.fetch_sub_u64 = view.fetch_sub_u64
        self._fence = atomicshm.fence
        self._acquire = atomicshm.ACQUIRE
        self._release = atomicshm.RELEASE

    def fence_acquire(self) -> None:
        """``atomic_thread_fence(memory_order_acquire)``: loads before it are not satisfied
        after loads that follow it."""
        self._fence(self._acquire)

    def fence_release(self) -> None:
        """``atomic_thread_fence(memory_order_release)``: loads and stores before it are
        visible before stores that follow it."""
        self._fence(self._release)

    def close(self) -> None:
        """Release the buffer (a mapping cannot be closed while a view holds it)."""
        for name in (
            "load_u8",
            "store_u8",
            "load_u16",
            "load_u32",
            "store_u32",
            "cas_u32",
            "load_u64",
            "store_u64",
            "cas_u64",
            "fetch_add_u64",
            "fetch_sub_u64",
        ):
            self.__dict__.pop(name, None)
        self._view.close()


_ACQUIRE: Final = 2  # __ATOMIC_ACQUIRE
_RELEASE: Final = 3  # __ATOMIC_RELEASE
_SEQ_CST: Final = 5  # __ATOMIC_SEQ_CST


def _libatomic() -> ctypes.CDLL:
    for name in ("libatomic.so.1", "libatomic.so", "libatomic.dylib"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise ImportError("no system libatomic (libatomic.so.1) for the ctypes atomics backend")


class _LibAtomics:
    """The ctypes backend: libatomic's generic ``__atomic_*_N`` entry points by address.

    The base address is taken once from a ctypes view of the buffer (which holds the buffer
    until `close`); each operation is one foreign call with an integer address.
    """

    backend = "libatomic"

    def __init__(self, buffer: memoryview) -> None:
        lib = _libatomic()
        self._anchor: Any = (ctypes.c_char * len(buffer)).from_buffer(buffer)
        self._base = ctypes.addressof(self._anchor)
        self._expected = ctypes.c_uint64(0)
        self._expected_at = ctypes.addressof(self._expected)
        types = {1: ctypes.c_uint8, 2: ctypes.c_uint16, 4: ctypes.c_uint32, 8: ctypes.c_uint64}
        self._fn: dict[str, Any] = {}
        # libatomic's C11 atomic_thread_fence (LIBATOMIC_1.2, GCC >= 7); `__atomic_thread_fence`
        # is a compiler builtin with no symbol.
        fence = getattr(lib, "atomic_thread_fence", None)
        if fence is None:
            raise ImportError("the system libatomic has no atomic_thread_fence (GCC < 7)")
        fence.argtypes, fence.restype = [ctypes.c_int], None
        self._fn["fence"] = fence
        for size, ctype in types.items():
            load = getattr(lib, f"__atomic_load_{size}")
            load.argtypes, load.restype = [ctypes.c_void_p, ctypes.c_int], ctype
            store = getattr(lib, f"__atomic_store_{size}")
            store.argtypes, store.restype = [ctypes.c_void_p, ctype, ctypes.c_int], None
            cas = getattr(lib, f"__atomic_compare_exchange_{size}")
            cas.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctype, ctypes.c_int, ctypes.c_int]
            cas.restype = ctypes.c_bool
            add = getattr(lib, f"__atomic_fetch_add_{size}")
            add.argtypes, add.restype = [ctypes.c_void_p, ctype, ctypes.c_int], ctype
            sub = getattr(lib, f"__atomic_fetch_sub_{size}")
            sub.argtypes, sub.restype = [ctypes.c_void_p, ctype, ctypes.c_int], ctype
            self._fn.update(
                {
                    f"load{size}": load,
                    f"store{size}": store,
                    f"cas{size}": cas,
                    f"add{size}": add,
                    f"sub{size}": sub,
                }
            )

    def close(self) -> None:
        self._fn.clear()
        del self._anchor

    def fence_acquire(self) -> None:
        self._fn["fence"](_ACQUIRE)

    def fence_release(self) -> None:
        self._fn["fence"](_RELEASE)

    def load_u8(self, offset: int) -> int:
        return int(self._fn["load1"](self._base + offset, _SEQ_CST))

    def store_u8(self, offset: int, value: int) -> None:
        self._fn["store1"](self._base + offset, value, _SEQ_CST)

    def load_u16(self, offset: int) -> int:
        return int(self._fn["load2"](self._base + offset, _SEQ_CST))

    def load_u32(self, offset: int) -> int:
        return int(self._fn["load4"](self._base + offset, _SEQ_CST))

    def store_u32(self, offset: int, value: int) -> None:
        self._fn["store4"](self._base + offset, value, _SEQ_CST)

    def cas_u32(self, offset: int, expected: int, desired: int) -> int:
        return self._cas(4, offset, expected, desired)

    def load_u64(self, offset: int) -> int:
        return int(self._fn["load8"](self._base + offset, _SEQ_CST))

    def store_u64(self, offset: int, value: int) -> None:
        self._fn["store8"](self._base + offset, value, _SEQ_CST)

    def cas_u64(self, offset: int, expected: int, desired: int) -> int:
        return self._cas(8, offset, expected, desired)

    def fetch_add_u64(self, offset: int, value: int) -> int:
        return int(self._fn["add8"](self._base + offset, value, _SEQ_CST))

    def fetch_sub_u64(self, offset: int, value: int) -> int:
        return int(self._fn["sub8"](self._base + offset, value, _SEQ_CST))

    def _cas(self, size: int, offset: int, expected: int, desired: int) -> int:
        """Compare-and-swap; returns the value found (== expected on success), as atomicshm."""
        self._expected.value = expected
        self._fn[f"cas{size}"](self._base + offset, self._expected_at, desired, _SEQ_CST, _SEQ_CST)
        found = self._expected.value
        return int(found & ((1 << (8 * size)) - 1))


Atomics = _SharedMemoryAtomics | _LibAtomics


def backends() -> list[str]:
    """The backends that can be loaded here, fastest first."""
    found = []
    try:
        import atomicshm  # noqa: F401

        found.append("atomicshm")
    except ImportError:
        pass
    try:
        _libatomic()
        found.append("libatomic")
    except ImportError:
        pass
    return found


def atomics_for(buffer: memoryview, backend: str | None = None) -> Atomics:
    """Atomic access to `buffer` (page-aligned: a shared-memory mapping).

    Args:
        backend: "atomicshm" or "libatomic"; default: ``$CHANGEFEED_IPC_ATOMICS``, else the
            fastest available.

    Raises:
        ImportError: no backend can be loaded.
    """
    wanted = backend or os.environ.get(BACKEND_ENV) or None
    available = backends()
    if wanted is None:
        if not available:
            raise ImportError("changefeed.ipc needs atomicshm or the system libatomic")
        wanted = available[0]
    if wanted == "atomicshm":
        return _SharedMemoryAtomics(buffer)
    if wanted == "libatomic":
        return _LibAtomics(buffer)
    raise ValueError(f"unknown atomics backend {wanted!r} (atomicshm or libatomic)")
