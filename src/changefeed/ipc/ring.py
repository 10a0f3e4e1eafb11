"""The slot protocol on the control segment's words, shared by the provider and the proxy.

A slot's state word is ``seq << 16 | refcount`` (seq 0: empty; SEQ_IN_WRITING: the provider is
writing it). The provider claims a slot by CAS from (seq, 0 refs) to IN_WRITING — a reader's
reference in between makes the CAS fail — writes it, stores (new seq, 0), the index entry and
the head. A reader references batch ``seq`` by CAS from (seq, n) to (seq, n + 1) inside a
transaction of its log; seq never repeats (48 bits), so a reused slot cannot be mistaken for
the batch it held before (no ABA). The provider and the model test (tests/ipc) both run these
functions, so the test checks the code that runs.
"""

from __future__ import annotations

from changefeed.ipc import txlog as _txlog
from changefeed.ipc.atomic import Atomics
from changefeed.ipc.layout import (
    HEAD_SEQ_AT,
    IN_WRITING_WORD,
    REFCOUNT_BITS,
    REFCOUNT_MASK,
    SEQ_IN_WRITING,
    ControlLayout,
)
from changefeed.ipc.txlog import TransactionLog

_crash = _txlog._crash


class NoFreeSlotError(RuntimeError):
    """Every slot is referenced: impossible while readers keep to the subscription budget."""


def claim_slot(a: Atomics, states: list[int], *, prefer: int = -1, rounds: int = 1000) -> int:
    """CAS an unreferenced slot — empty first, then the one holding the oldest batch — to
    IN_WRITING; returns its index. `prefer` (the provider's own guess at the oldest slot, from
    the seqs it wrote) is tried first, with one load and one CAS.

    Raises:
        NoFreeSlotError: `rounds` scans found every slot referenced.
    """
    if prefer >= 0:
        word = a.load_u64(states[prefer])
        free = word & REFCOUNT_MASK == 0 and word != IN_WRITING_WORD
        if free and a.cas_u64(states[prefer], word, IN_WRITING_WORD) == word:
            return _claimed(a, prefer)
    for _ in range(rounds):  # bounded: readers hold at most slot_count - 1 (the budget)
        candidates = []
        for slot, at in enumerate(states):
            word = a.load_u64(at)
            if word & REFCOUNT_MASK == 0 and word != IN_WRITING_WORD:
                candidates.append((word >> REFCOUNT_BITS, slot, word))
        candidates.sort()
        for _, slot, word in candidates:
            if a.cas_u64(states[slot], word, IN_WRITING_WORD) == word:
                return _claimed(a, slot)
    raise NoFreeSlotError(f"all {len(states)} slots referenced for {rounds} scans")


def _claimed(a: Atomics, slot: int) -> int:
    # Release fence, paired with the acquire fence of a reader's validated copy
    # (`Subscription.positions_of`, `stats.service_stats`): the caller's stores into the slot
    # come after this, so none is visible before the IN_WRITING state (a CAS alone orders
    # only its own store on a weakly ordered CPU).
    a.fence_release()
    return slot


def commit_slot(a: Atomics, layout: ControlLayout, slot: int, seq: int) -> None:
    """Make batch `seq`, written into `slot`, readable: state, index entry, then the head.

    The state store is seq_cst (a release): every store into the slot before it is visible to
    a reader whose load (its reference CAS, or `find_slot`) sees the new state.
    """
    a.store_u64(layout.slot_state(slot), seq << REFCOUNT_BITS)
    a.store_u64(layout.index_entry(seq), seq << REFCOUNT_BITS | slot)
    a.store_u64(HEAD_SEQ_AT, seq)


def find_slot(a: Atomics, layout: ControlLayout, seq: int) -> int | None:
    """The slot holding batch `seq` now (index entry, else a scan); None if none does."""
    entry = a.load_u64(layout.index_entry(seq))
    if entry >> REFCOUNT_BITS == seq:
        return entry & 0xFFFF
    for slot in range(layout.geometry.slot_count):
        if a.load_u64(layout.slot_state(slot)) >> REFCOUNT_BITS == seq:
            return slot
    return None


def reference(a: Atomics, layout: ControlLayout, txlog: TransactionLog, seq: int) -> int | None:
    """Take a reference on batch `seq` inside a transaction; its slot, or None if no slot holds
    it any more (the transaction is aborted)."""
    slot = find_slot(a, layout, seq)
    if slot is None:
        return None
    at = layout.slot_state(slot)
    txlog.reference_begin(slot)
    _crash("reference.begun", txlog.index, slot)
    while True:  # a CAS loop: each failure is another reader's reference or a reuse
        word = a.load_u64(at)
        if word >> REFCOUNT_BITS != seq:
            txlog.reference_abort(slot)
            return None
        if a.cas_u64(at, word, word + 1) == word:
            break
    _crash("reference.taken", txlog.index, slot)
    txlog.reference_commit(slot)
    _crash("reference.committed", txlog.index, slot)
    return slot


def dereference(a: Atomics, layout: ControlLayout, txlog: TransactionLog, slot: int) -> None:
    """Give back a reference inside a transaction."""
    txlog.dereference_begin(slot)
    _crash("dereference.begun", txlog.index, slot)
    a.fetch_sub_u64(layout.slot_state(slot), 1)
    _crash("dereference.released", txlog.index, slot)
    txlog.dereference_commit(slot)
    _crash("dereference.committed", txlog.index, slot)


def clean_for_reuse(a: Atomics, layout: ControlLayout) -> tuple[int, int]:
    """A restarted provider's repair: slots left IN_WRITING become empty, the index is rebuilt
    from the slots, the head is the newest seq seen. Returns (slots cleaned, head)."""
    geometry = layout.geometry
    cleaned = 0
    newest = a.load_u64(HEAD_SEQ_AT)
    ready: list[tuple[int, int]] = []
    for slot in range(geometry.slot_count):
        at = layout.slot_state(slot)
        seq = a.load_u64(at) >> REFCOUNT_BITS
        if seq == SEQ_IN_WRITING:
            a.store_u64(at, 0)  # the crashed provider's half-written batch (no reader has it)
            cleaned += 1
        elif seq:
            ready.append((seq, slot))
            newest = max(newest, seq)
    for entry in range(geometry.index_entries):
        a.store_u64(layout.index_at + 8 * entry, 0)
    for seq, slot in sorted(ready):
        a.store_u64(layout.index_entry(seq), seq << REFCOUNT_BITS | slot)
    a.store_u64(HEAD_SEQ_AT, newest)
    return cleaned, newest
