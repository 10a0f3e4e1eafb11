"""The failover log of one vbucket, and the DCP rollback decision made from it.

A failover log is a vbucket's history of branches: a list of ``(vb_uuid, seqno)`` entries, newest
first, at most ``FAILOVER_LOG_ENTRIES_MAX`` (25). Entry ``(u, s)`` says "branch ``u`` began at
seqno ``s``": up to ``s`` its history is that of the entry below it, after ``s`` it is its own. A
vbucket adds an entry whenever it becomes active (dcp-wire.md §9.4).

``FailoverLog.needs_rollback`` is the producer's rollback decision for a stream request
(dcp-wire.md §9.1, seed dcp-rollback.md; where they disagree the reference wins: the purge rule
compares the *start* seqno, not snap_start, and a client that saw the current purge seqno is
spared). It is pure: it reads the log and its arguments and changes nothing. The consumer side of
a rollback is ``prune_after`` + ``entry_for_rollback``, then ``replace`` once a stream succeeds.

Whose fault (STYLE.md §1, §3):
- entries from outside (a peer's failover log, a saved session state) are checked and rejected
  with ``FailoverLogError``, a ``ValueError``;
- our own code misusing the API (a seqno out of range, a stream request breaking
  ``snap_start <= start <= snap_end``, which the producer must answer with ERANGE *before* asking
  us) gets ``ValueError`` or ``TypeError``;
- a broken internal invariant fails an ``assert``.

vb_uuid widths: a vb_uuid is a u64 on the wire. We *create* uuids of at most ``VB_UUID_BITS``
(48) bits, as kv_engine does (a random u64 shifted right by 16), but we *accept* any non-zero u64
from a peer or a saved state: another implementation may draw all 64 bits, rejecting its log
would leave the vbucket unusable, and a wider uuid costs us nothing.

Uniqueness: no two entries share a vb_uuid. ``create_entry`` draws a uuid that is not in the log
and every way in (constructor, ``replace``, ``from_json``, ``from_list``) rejects duplicates. A
duplicate would make "the entry matching the consumer's uuid" ambiguous: its two matches give
two different ``upper`` values and one of them overstates the shared history, so we refuse
duplicates rather than pick one.

This module does not encode or decode the 16-byte wire entries (protocol/ does), persist anything
(storage/ does), or talk to a peer; it imports no I/O module.
"""

from __future__ import annotations

import enum
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

from changefeed.limits import FAILOVER_LOG_ENTRIES_MAX, SEQNO_MAX, VB_UUID_BITS

__all__ = [
    "VB_UUID_CREATED_MAX",
    "VB_UUID_WIRE_MAX",
    "FailoverLog",
    "FailoverLogError",
    "RollbackDecision",
    "RollbackReason",
]

# Largest vb_uuid we accept from a peer or a saved state: any u64 (see the module docstring).
VB_UUID_WIRE_MAX = 2**64 - 1

# Largest vb_uuid create_entry makes: VB_UUID_BITS (48) bits, like kv_engine.
VB_UUID_CREATED_MAX = 2**VB_UUID_BITS - 1

# Draws create_entry makes before giving up. A draw fails only if it is 0 or already in the log:
# with at most 25 uuids among 2**48 values one draw fails with p < 2**-43, so 8 failures in a
# row (p < 2**-344) means the rng is broken (e.g. a fake that always answers 0), not unlucky.
_UUID_DRAWS_MAX = 8

# Longest JSON text from_json parses. A full log printed compactly takes
# 25 * len("[18446744073709551615,18446744073709551615],") = 25 * 44 characters; we allow 4x that
# for whitespace (pretty printing) and refuse more *before* parsing, so a corrupt or hostile state
# file cannot make us build a large object.
_JSON_CHARS_MAX = 4 * 44 * FAILOVER_LOG_ENTRIES_MAX + 64

assert 0 < VB_UUID_BITS <= 64, VB_UUID_BITS
assert VB_UUID_CREATED_MAX <= VB_UUID_WIRE_MAX
assert FAILOVER_LOG_ENTRIES_MAX >= 1, FAILOVER_LOG_ENTRIES_MAX
assert _JSON_CHARS_MAX > 44 * FAILOVER_LOG_ENTRIES_MAX, _JSON_CHARS_MAX


class FailoverLogError(ValueError):
    """A failover log from outside (a peer, a saved session state) is malformed.

    Raised instead of building a log that would break the invariants the rollback decision
    relies on: non-empty, at most ``capacity`` entries, vb_uuids non-zero u64 and unique, seqnos
    u64 and non-increasing from newest to oldest.
    """


class RollbackReason(enum.Enum):
    """Which rule of dcp-wire.md §9.1 decided a stream request."""

    # Rule 1: start 0 with uuid 0 (or without StrictVbUuid): nothing to check.
    BASE_CASE = "base_case"
    # Rule 4a: uuid found and the consumer's snapshot ends at or below upper (lagging consumer).
    NONE_NEEDED = "none_needed"
    # Rule 2: the consumer is behind the purge seqno; it may have missed purged tombstones.
    PURGE = "purge"
    # Rule 3: the consumer's uuid is not in the log; no known common history.
    DIVERGED = "diverged"
    # Rule 4b: upper < snap_start; the whole snapshot lies past the common history.
    LEADING = "leading"
    # Rule 4c: snap_start <= upper < snap_end; the common history ends inside the snapshot.
    SNAPSHOT_MISMATCH = "snapshot_mismatch"


_ROLLBACK_REASONS = frozenset(
    {
        RollbackReason.PURGE,
        RollbackReason.DIVERGED,
        RollbackReason.LEADING,
        RollbackReason.SNAPSHOT_MISMATCH,
    }
)
_FULL_ROLLBACK_REASONS = frozenset({RollbackReason.PURGE, RollbackReason.DIVERGED})


@dataclass(frozen=True, slots=True)
class RollbackDecision:
    """The answer to a stream request: stream on, or roll back to ``seqno`` first.

    Attributes:
        rollback: True when the consumer must roll back (the producer answers status 0x23).
        seqno: the rollback seqno when ``rollback``; otherwise the start seqno the stream resumes
            from.
        reason: the rule that decided; its rolling-back-ness always agrees with ``rollback``.
    """

    rollback: bool
    seqno: int
    reason: RollbackReason

    def __post_init__(self) -> None:
        if self.rollback != (self.reason in _ROLLBACK_REASONS):
            raise ValueError(f"rollback={self.rollback} contradicts reason {self.reason.name}")
        if not 0 <= self.seqno <= SEQNO_MAX:
            raise ValueError(f"seqno {self.seqno} is not a u64")
        if self.reason in _FULL_ROLLBACK_REASONS and self.seqno != 0:
            raise ValueError(f"{self.reason.name} always rolls back to 0, not {self.seqno}")


def _is_int(value: object) -> bool:
    # bool is an int subclass, and JSON true would otherwise pass as 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: int) -> str:
    # Messages name an out-of-range value without converting a huge one to text, which would be
    # slow and, past 4300 digits, raise an unrelated ValueError.
    return str(value) if value.bit_length() <= 128 else f"<{value.bit_length()}-bit integer>"


def _require_u64(name: str, value: object, maximum: int = SEQNO_MAX) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    assert isinstance(value, int)
    if not 0 <= value <= maximum:
        raise ValueError(f"{name} {_show(value)} is out of range 0..{maximum}")
    return value


def _require_capacity(capacity: object) -> int:
    if not _is_int(capacity):
        raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
    assert isinstance(capacity, int)
    if not 1 <= capacity <= FAILOVER_LOG_ENTRIES_MAX:
        raise ValueError(f"capacity {capacity} is out of range 1..{FAILOVER_LOG_ENTRIES_MAX}")
    return capacity


def _validated_entry(index: int, entry: object) -> tuple[int, int]:
    if not isinstance(entry, list | tuple) or len(entry) != 2:
        raise FailoverLogError(f"failover log entry {index} is not a [vb_uuid, seqno] pair")
    vb_uuid, seqno = entry
    if not _is_int(vb_uuid) or not _is_int(seqno):
        raise FailoverLogError(f"failover log entry {index} holds a non-integer: {entry!r:.80}")
    assert isinstance(vb_uuid, int)
    assert isinstance(seqno, int)
    if not 0 < vb_uuid <= VB_UUID_WIRE_MAX:
        raise FailoverLogError(
            f"failover log entry {index}: vb_uuid {_show(vb_uuid)} is not a non-zero u64 "
            "(0 means 'no history' and is never a branch)"
        )
    if not 0 <= seqno <= SEQNO_MAX:
        raise FailoverLogError(f"failover log entry {index}: seqno {_show(seqno)} is not a u64")
    return vb_uuid, seqno


def _validated_entries(entries: object, capacity: int) -> list[tuple[int, int]]:
    """Check entries that came from outside and return them as a fresh list of tuples."""
    if not isinstance(entries, list | tuple):
        raise FailoverLogError(
            f"failover log must be a list of [vb_uuid, seqno] pairs, got {type(entries).__name__}"
        )
    if not entries:
        raise FailoverLogError("failover log is empty: a vbucket always has at least one entry")
    # Checked before walking the entries, so an oversized log costs O(1) to refuse.
    if len(entries) > capacity:
        raise FailoverLogError(
            f"failover log has {len(entries)} entries, more than the capacity {capacity}"
        )
    result: list[tuple[int, int]] = []
    seen: set[int] = set()
    for index, entry in enumerate(entries):
        vb_uuid, seqno = _validated_entry(index, entry)
        if vb_uuid in seen:
            raise FailoverLogError(
                f"failover log entry {index}: vb_uuid {vb_uuid} appears twice; a branch has one"
                " entry, and a duplicate would make the rollback point ambiguous"
            )
        if result and seqno > result[-1][1]:
            raise FailoverLogError(
                f"failover log entry {index}: seqno {seqno} > {result[-1][1]} of entry"
                f" {index - 1}; entries must be newest first (seqnos non-increasing)"
            )
        seen.add(vb_uuid)
        result.append((vb_uuid, seqno))
    assert len(result) == len(entries), (len(result), len(entries))
    assert 1 <= len(result) <= capacity, (len(result), capacity)
    return result


def _draw_vb_uuid(rng: random.Random, taken: set[int]) -> int:
    for _ in range(_UUID_DRAWS_MAX):
        # kv_engine draws a random u64 and keeps the top VB_UUID_BITS bits.
        vb_uuid = rng.getrandbits(64) >> (64 - VB_UUID_BITS)
        if vb_uuid != 0 and vb_uuid not in taken:
            assert 0 < vb_uuid <= VB_UUID_CREATED_MAX, vb_uuid
            return vb_uuid
    raise RuntimeError(
        f"rng produced {_UUID_DRAWS_MAX} unusable vb_uuids in a row (zero or already in the"
        " log); it is broken"
    )


class FailoverLog:
    """The failover log of one vbucket: ``(vb_uuid, seqno)`` entries, newest first.

    Not thread-safe; one vbucket (or one consumer stream) owns it.
    """

    __slots__ = ("_capacity", "_entries", "_rng", "dropped_above")

    def __init__(
        self,
        entries: Sequence[tuple[int, int]],
        capacity: int = FAILOVER_LOG_ENTRIES_MAX,
        *,
        rng: random.Random | None = None,
    ) -> None:
        """Build a log from existing entries (a brand-new vbucket uses ``fresh`` instead).

        Args:
            entries: ``(vb_uuid, seqno)`` pairs, newest first. They may come from a peer, so they
                are checked like decoded data.
            capacity: most entries kept; ``create_entry`` drops the oldest beyond it. 1..25
                (kv_engine's ``max_failover_entries``); tests use small values.
            rng: source of new vb_uuids. Pass a seeded ``random.Random`` for replayable runs;
                the default is ``random.SystemRandom`` so nodes never draw the same sequence.

        Raises:
            FailoverLogError: entries empty, over capacity, with a zero, duplicate or out-of-range
                vb_uuid, an out-of-range seqno, or seqnos increasing from newest to oldest.
            ValueError: capacity outside 1..FAILOVER_LOG_ENTRIES_MAX.
            TypeError: capacity is not an int.
        """
        self._capacity = _require_capacity(capacity)
        self._entries = _validated_entries(entries, self._capacity)
        self._rng: random.Random = random.SystemRandom() if rng is None else rng
        # The entries the last `create_entry` dropped because they lay above its seqno: a
        # recovery reports so that its branch began past what the disk kept (a crashed
        # active's copy may lack what it acknowledged before: rules.copy_holds_its_branch).
        self.dropped_above: tuple[tuple[int, int], ...] = ()
        assert 1 <= len(self._entries) <= self._capacity, (len(self._entries), self._capacity)

    @classmethod
    def fresh(
        cls, capacity: int = FAILOVER_LOG_ENTRIES_MAX, *, rng: random.Random | None = None
    ) -> FailoverLog:
        """Build the log of a brand-new vbucket: one entry ``(new vb_uuid, 0)`` (§9.4).

        Args:
            capacity: as the constructor.
            rng: as the constructor; it also draws the first vb_uuid.

        Returns:
            The log, with a vb_uuid that is non-zero and at most VB_UUID_BITS bits.

        Raises:
            ValueError, TypeError: capacity is invalid (as the constructor).
            RuntimeError: the rng is broken (as ``create_entry``).
        """
        _require_capacity(capacity)
        source: random.Random = random.SystemRandom() if rng is None else rng
        return cls([(_draw_vb_uuid(source, set()), 0)], capacity, rng=source)

    # -- reading ---------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Most entries the log keeps."""
        return self._capacity

    @property
    def latest(self) -> tuple[int, int]:
        """The newest entry ``(vb_uuid, seqno)``: the uuid a consumer sends in a stream request."""
        assert self._entries, "a failover log is never empty"
        return self._entries[0]

    @property
    def entries(self) -> list[tuple[int, int]]:
        """A copy of the entries, newest first; changing it does not change the log."""
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FailoverLog):
            return NotImplemented
        return self._entries == other._entries and self._capacity == other._capacity

    __hash__ = None  # type: ignore[assignment]  # mutable: equal logs may diverge later

    def __repr__(self) -> str:
        return f"FailoverLog({self._entries!r}, capacity={self._capacity})"

    def entry_for_rollback(self, seqno: int) -> tuple[int, int]:
        """Return the newest entry whose seqno is at most ``seqno``.

        After rolling back to ``seqno`` a consumer re-requests with this entry's vb_uuid and
        ``start = snap_start = snap_end = seqno`` (dcp-wire.md §9.1, client handling): it is the
        newest branch whose history the consumer still holds all of up to ``seqno``.

        Args:
            seqno: the rollback seqno the producer answered.

        Returns:
            The ``(vb_uuid, seqno)`` entry.

        Raises:
            LookupError: every entry is newer than ``seqno``; call ``prune_after(seqno)`` first,
                which leaves an entry at or below it.
            ValueError, TypeError: seqno is not a u64.
        """
        _require_u64("seqno", seqno)
        for entry in self._entries:
            if entry[1] <= seqno:
                return entry
        raise LookupError(
            f"no failover log entry at or below seqno {seqno} (oldest is {self._entries[-1]});"
            " call prune_after(seqno) first"
        )

    # -- changing --------------------------------------------------------------------------------

    def create_entry(self, high_seqno: int) -> int:
        """Start a new branch at ``high_seqno`` (the vbucket became active) and return its uuid.

        Entries with seqno above ``high_seqno`` are dropped first: they describe a branch this
        vbucket no longer holds (kv_engine ``createEntry``); they are kept in ``dropped_above``
        until the next call. The new entry goes in front; past ``capacity`` the oldest entry
        is dropped.

        Args:
            high_seqno: the seqno the new branch starts after.

        Returns:
            The new vb_uuid: non-zero, at most VB_UUID_BITS bits, in no entry the log held
            when called (including the ones this call drops, so a consumer still on a dropped
            branch can never be mistaken for one on the new branch).

        Raises:
            ValueError, TypeError: high_seqno is not a u64.
            RuntimeError: the rng gave _UUID_DRAWS_MAX unusable uuids in a row (it is broken).
        """
        _require_u64("high_seqno", high_seqno)
        vb_uuid = _draw_vb_uuid(self._rng, {entry_uuid for entry_uuid, _ in self._entries})
        kept = [entry for entry in self._entries if entry[1] <= high_seqno]
        self.dropped_above = tuple(entry for entry in self._entries if entry[1] > high_seqno)
        self._entries = [(vb_uuid, high_seqno), *kept][: self._capacity]
        assert self._entries[0] == (vb_uuid, high_seqno), self._entries[0]
        assert len(self._entries) <= self._capacity, (len(self._entries), self._capacity)
        if len(self._entries) > 1:
            assert self._entries[1][1] <= high_seqno, (self._entries[1], high_seqno)
        return vb_uuid

    def prune_after(self, seqno: int) -> None:
        """Forget the branches above ``seqno``: the consumer rolled its data back to ``seqno``.

        Drops entries with seqno above ``seqno`` (dcp-wire.md §9.4). If none is left the
        consumer holds history that no entry describes, so a new entry at ``seqno`` is created.

        Args:
            seqno: the rollback seqno.

        Raises:
            ValueError, TypeError: seqno is not a u64.
            RuntimeError: a new entry was needed and the rng is broken (as ``create_entry``).
        """
        _require_u64("seqno", seqno)
        # Entries are newest first, so the oldest (last) has the smallest seqno.
        if self._entries[-1][1] > seqno:
            self.create_entry(seqno)
        else:
            self._entries = [entry for entry in self._entries if entry[1] <= seqno]
        assert self._entries, "a failover log is never empty"
        assert self._entries[0][1] <= seqno, (self._entries[0], seqno)

    def replace(self, entries: Sequence[tuple[int, int]]) -> None:
        """Replace every entry with the producer's log (after a successful stream request).

        Args:
            entries: the producer's entries, newest first.

        Raises:
            FailoverLogError: as the constructor; the log is left unchanged.
        """
        validated = _validated_entries(entries, self._capacity)
        self._entries = validated
        assert 1 <= len(self._entries) <= self._capacity, (len(self._entries), self._capacity)

    # -- the rollback decision -------------------------------------------------------------------

    def needs_rollback(
        self,
        start_seqno: int,
        vb_uuid: int,
        snap_start: int,
        snap_end: int,
        high_seqno: int,
        purge_seqno: int,
        *,
        strict_vb_uuid: bool = False,
        client_purge_seqno: int | None = None,
        ignore_purged_tombstones: bool = False,
    ) -> RollbackDecision:
        """Decide whether a consumer's stream request must roll back, and to which seqno.

        The producer calls this on its own log (dcp-wire.md §6.2 step 7); it changes nothing.
        Rules of §9.1 in order, each cited in the code: (0) normalise the snapshot to what the
        consumer holds; (1) start 0 with uuid 0, or without strict: no rollback; (2) ``0 < start
        < purge_seqno``, not waived: to 0; (3) uuid not in the log: to 0; (4) with ``upper`` the
        next newer entry's seqno (high_seqno for the newest): ``snap_end <= upper`` no rollback,
        ``upper < snap_start`` to upper, else to snap_start.

        Args:
            start_seqno: last seqno the consumer has.
            vb_uuid: the consumer's newest vb_uuid; 0 means "I have no history".
            snap_start: start of the consumer's current snapshot.
            snap_end: end of the consumer's current snapshot.
            high_seqno: the producer's high seqno. May be below start_seqno (a leading consumer);
                the producer rejects ``start > high_seqno`` with ERANGE only *after* this check.
            purge_seqno: the producer's purge seqno (at most high_seqno).
            strict_vb_uuid: stream flag StrictVbUuid (0x20): check the uuid even at start 0.
                A consumer rolled back to 0 this way must re-request with uuid 0, since its
                pruned log still holds the unknown uuid at seqno 0.
            client_purge_seqno: the purge seqno the consumer last saw (stream-request JSON
                ``purge_seqno``); equal to ``purge_seqno`` it waives rule 2 (kv_engine 8.0).
            ignore_purged_tombstones: stream flag IgnorePurgedTombstones (0x80): waive rule 2.

        Returns:
            The decision; when it rolls back, its seqno is at most ``start_seqno``.

        Raises:
            ValueError: ``snap_start <= start_seqno <= snap_end`` does not hold (the producer must
                answer ERANGE before asking), ``purge_seqno > high_seqno``, or a value is not a
                u64.
            TypeError: a seqno or uuid is not an int.
        """
        _require_stream_request(start_seqno, vb_uuid, snap_start, snap_end, high_seqno)
        _require_purge(purge_seqno, high_seqno, client_purge_seqno)
        # Rule 0 (§9.1): normalise the snapshot to what the consumer really holds.
        if start_seqno == snap_end:
            snap_start = snap_end
        if start_seqno == snap_start:
            snap_end = snap_start
        assert snap_start <= start_seqno <= snap_end, (snap_start, start_seqno, snap_end)
        # Rule 1 (§9.1.1): start 0 with uuid 0 never rolls back; with a uuid it goes on to the
        # uuid checks only under StrictVbUuid (rule 2 cannot apply: it needs start != 0).
        if start_seqno == 0 and (vb_uuid == 0 or not strict_vb_uuid):
            return RollbackDecision(False, 0, RollbackReason.BASE_CASE)
        # Rule 2 (§9.1.2): a consumer behind the purge seqno may have missed purged tombstones.
        # It compares start, not snap_start (§14 errata), and is waived by the flag or by a
        # client that already saw this purge seqno.
        waived = ignore_purged_tombstones or client_purge_seqno == purge_seqno
        if start_seqno != 0 and start_seqno < purge_seqno and not waived:
            return RollbackDecision(True, 0, RollbackReason.PURGE)
        decision = self._history_decision(start_seqno, vb_uuid, snap_start, snap_end, high_seqno)
        if decision.rollback:
            assert decision.seqno <= start_seqno, (decision, start_seqno)
        else:
            assert decision.seqno == start_seqno, (decision, start_seqno)
        return decision

    def _history_decision(
        self, start_seqno: int, vb_uuid: int, snap_start: int, snap_end: int, high_seqno: int
    ) -> RollbackDecision:
        """Rules 3 and 4 on a normalised snapshot."""
        index = next((i for i, entry in enumerate(self._entries) if entry[0] == vb_uuid), None)
        # Rule 3 (§9.1.3): no entry for the consumer's branch (uuid 0 never has one).
        if index is None:
            return RollbackDecision(True, 0, RollbackReason.DIVERGED)
        # Rule 4 (§9.1.4): the history of this branch is ours up to the next newer entry's
        # seqno, or up to our high seqno when it is our newest branch.
        upper = high_seqno if index == 0 else self._entries[index - 1][1]
        assert upper >= self._entries[index][1] or index == 0, (upper, self._entries[index])
        # Rule 4a: the whole snapshot lies in common history (a lagging consumer).
        if snap_end <= upper:
            return RollbackDecision(False, start_seqno, RollbackReason.NONE_NEEDED)
        # Rule 4b: the whole snapshot lies past common history (a leading consumer).
        if upper < snap_start:
            return RollbackDecision(True, upper, RollbackReason.LEADING)
        # Rule 4c: common history ends inside the snapshot; deduplication means the consumer is
        # only consistent at a snapshot boundary, so it goes back to the snapshot's start.
        assert snap_start <= upper < snap_end, (snap_start, upper, snap_end)
        return RollbackDecision(True, snap_start, RollbackReason.SNAPSHOT_MISMATCH)

    # -- encoding --------------------------------------------------------------------------------

    def to_list(self) -> list[list[int]]:
        """Return the entries as JSON-ready ``[[vb_uuid, seqno], ...]``, newest first.

        For embedding in a bigger JSON document (a consumer session state, a Spark offset).
        Values above 2**53 lose precision in JavaScript readers; ours are read by Python.
        """
        return [[vb_uuid, seqno] for vb_uuid, seqno in self._entries]

    def to_json(self) -> str:
        """Return the entries as a compact JSON array, newest first (see ``to_list``)."""
        return json.dumps(self.to_list(), separators=(",", ":"))

    @classmethod
    def from_list(
        cls,
        value: object,
        capacity: int = FAILOVER_LOG_ENTRIES_MAX,
        *,
        rng: random.Random | None = None,
    ) -> FailoverLog:
        """Build a log from the decoded JSON value ``to_list`` produced.

        Args:
            value: a list of ``[vb_uuid, seqno]`` pairs, newest first, as decoded from JSON.
            capacity: as the constructor.
            rng: as the constructor.

        Returns:
            The log.

        Raises:
            FailoverLogError: value is not a valid failover log (as the constructor).
        """
        return cls(_validated_entries(value, _require_capacity(capacity)), capacity, rng=rng)

    @classmethod
    def from_json(
        cls,
        text: str,
        capacity: int = FAILOVER_LOG_ENTRIES_MAX,
        *,
        rng: random.Random | None = None,
    ) -> FailoverLog:
        """Build a log from the JSON text ``to_json`` produced.

        Args:
            text: a JSON array of ``[vb_uuid, seqno]`` pairs, newest first.
            capacity: as the constructor.
            rng: as the constructor.

        Returns:
            The log.

        Raises:
            FailoverLogError: text is too long to be a failover log (checked before parsing),
                is not JSON, or is not a valid failover log (as the constructor).
            TypeError: text is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"failover log JSON must be a str, got {type(text).__name__}")
        if len(text) > _JSON_CHARS_MAX:
            raise FailoverLogError(
                f"failover log JSON is {len(text)} characters, more than {_JSON_CHARS_MAX}"
            )
        try:
            value = json.loads(text)
        # JSONDecodeError is a ValueError; so is an integer with too many digits to convert.
        except ValueError as error:
            raise FailoverLogError(f"failover log is not valid JSON: {error}") from error
        except RecursionError as error:
            raise FailoverLogError("failover log JSON nests too deeply") from error
        return cls.from_list(value, capacity, rng=rng)

    # -- checking --------------------------------------------------------------------------------

    def _check_invariants(self) -> None:
        """Walk every entry and assert what the rest of the class relies on (tests call this)."""
        assert 1 <= self._capacity <= FAILOVER_LOG_ENTRIES_MAX, self._capacity
        assert 1 <= len(self._entries) <= self._capacity, (len(self._entries), self._capacity)
        for vb_uuid, seqno in self._entries:
            assert _is_int(vb_uuid), vb_uuid
            assert _is_int(seqno), seqno
            assert 0 < vb_uuid <= VB_UUID_WIRE_MAX, vb_uuid
            assert 0 <= seqno <= SEQNO_MAX, seqno
        for newer, older in zip(self._entries, self._entries[1:], strict=False):
            assert newer[1] >= older[1], (newer, older)
        uuids = [vb_uuid for vb_uuid, _ in self._entries]
        assert len(set(uuids)) == len(uuids), uuids


def _require_stream_request(
    start_seqno: int, vb_uuid: int, snap_start: int, snap_end: int, high_seqno: int
) -> None:
    _require_u64("start_seqno", start_seqno)
    _require_u64("vb_uuid", vb_uuid, VB_UUID_WIRE_MAX)
    _require_u64("snap_start", snap_start)
    _require_u64("snap_end", snap_end)
    _require_u64("high_seqno", high_seqno)
    if not snap_start <= start_seqno <= snap_end:
        raise ValueError(
            f"stream request breaks snap_start <= start_seqno <= snap_end "
            f"({snap_start}, {start_seqno}, {snap_end}); answer ERANGE before asking for rollback"
        )


def _require_purge(purge_seqno: int, high_seqno: int, client_purge_seqno: int | None) -> None:
    _require_u64("purge_seqno", purge_seqno)
    if client_purge_seqno is not None:
        _require_u64("client_purge_seqno", client_purge_seqno)
    if purge_seqno > high_seqno:
        raise ValueError(f"purge_seqno {purge_seqno} > high_seqno {high_seqno}")
