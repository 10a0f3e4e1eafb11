"""What a chaos run records: plain data shared by the loader, the consumer, the nemesis and the
checker. Nothing here talks to a node, so the checker's unit tests build these by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple


class Outcome(StrEnum):
    """What a client may conclude about one write (Jepsen's ok / fail / info)."""

    OK = "ok"  # acknowledged: it took effect (at the durability level it asked for)
    FAILED = "failed"  # definitely did not take effect (a status that says so, no retry sent it)
    AMBIGUOUS = "ambiguous"  # may or may not have: timeout, SYNC_WRITE_AMBIGUOUS, connection lost


@dataclass(frozen=True, slots=True)
class WriteRecord:
    """One upsert of the loader. Each key is written by one worker only, one write at a time,
    with ``version`` 1, 2, 3...; the value carries the version, so the final value says which
    write won (``value_for`` / ``version_of``)."""

    key: bytes
    version: int
    outcome: Outcome
    durable: bool  # asked for a SyncWrite level (majority...), not "none"
    error: str = ""
    started_s: float = 0.0  # seconds since the run started
    ended_s: float = 0.0


def value_for(key: bytes, version: int, padding: int = 0) -> bytes:
    """The value the loader writes as ``version`` of ``key``."""
    return b"%s|v%d|%s" % (key, version, b"x" * padding)


def version_of(key: bytes, value: bytes) -> int | None:
    """The version a value written by the loader carries; None for a value the loader never
    wrote for ``key`` (another key's value, or garbage)."""
    parts = value.split(b"|")
    if len(parts) != 3 or parts[0] != key or not parts[1].startswith(b"v"):
        return None
    digits = parts[1][1:]
    return int(digits) if digits.isdigit() else None


class Version(NamedTuple):
    """A key's newest change with the metadata copies and consumers must agree on."""

    seqno: int
    value: bytes
    cas: int
    rev_seqno: int
    deleted: bool


@dataclass
class ConsumerHistory:
    """What the streaming consumer received, per vbucket, in arrival order.

    ``timeline[vb]`` holds ("item", seqno) and ("rollback", seqno) entries: the checker looks
    for seqnos that do not rise outside rollbacks there. ``state[vb]`` is the consumer's view
    with its rollbacks applied: key -> the newest change it holds."""

    timeline: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    changes: dict[int, list[tuple[bytes, Version]]] = field(default_factory=dict)
    rollbacks: int = 0
    disconnects: int = 0
    refusals: int = 0
    restarts: int = 0  # the client failed and was built again from its session state
    items: int = 0

    def item(self, vb: int, key: bytes, version: Version) -> None:
        self.timeline.setdefault(vb, []).append(("item", version.seqno))
        self.changes.setdefault(vb, []).append((key, version))
        self.items += 1

    def rollback(self, vb: int, seqno: int) -> None:
        self.timeline.setdefault(vb, []).append(("rollback", seqno))
        self.changes[vb] = [(k, v) for k, v in self.changes.get(vb, []) if v.seqno <= seqno]
        self.rollbacks += 1

    def state(self) -> dict[bytes, Version]:
        """key -> newest change the consumer holds (rollbacks applied)."""
        out: dict[bytes, Version] = {}
        for changes in self.changes.values():
            for key, version in changes:
                out[key] = version
        return out


@dataclass(frozen=True, slots=True)
class FaultRecord:
    """One fault as it was injected: what, on which nodes, when, and when it was healed."""

    kind: str
    nodes: tuple[str, ...]
    at_s: float
    healed_s: float
    note: str = ""

    def __str__(self) -> str:
        extra = f" ({self.note})" if self.note else ""
        return (
            f"{self.at_s:7.1f}s {self.kind:<7} {','.join(self.nodes):<8} "
            f"for {self.healed_s - self.at_s:5.1f}s{extra}"
        )
