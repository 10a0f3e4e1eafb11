"""Tests for changefeed.failover: the failover log and the DCP rollback decision.

Three layers:

1. Named examples: one per rule of dcp-wire.md §9.1 (and per boundary of each rule), and one
   per log operation.
2. Properties of the log operations against a plain-list model (drop newer, drop oldest, uuids).
3. Properties of ``needs_rollback`` against an independent model of *history*. The model never
   looks at failover entries to decide what two nodes share: every node holds the list of
   mutations it has, each named by the branch (uuid) whose active wrote it, and the true common
   history of producer and consumer is simply their longest equal prefix. The failover logs are
   only the metadata the model nodes keep alongside, built by the model's own rules, and are what
   the code under test sees. Checked: (1) a rollback point never lies above the common history
   nor above the last point where the consumer's data is consistent (its snapshot start, when it
   holds only part of a deduplicated snapshot); (2) a consumer that is not rolled back holds only
   common history; a plainly lagging consumer is not rolled back; (3) a consumer that follows the
   client rules (prune_after, entry_for_rollback, re-request) agrees with the producer within
   three requests.

Randomness: the examples use fixed seeds (printed where used); hypothesis prints a failing
example and its reproduction blob.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from dataclasses import dataclass

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from changefeed.failover import (
    VB_UUID_CREATED_MAX,
    VB_UUID_WIRE_MAX,
    FailoverLog,
    FailoverLogError,
    RollbackDecision,
    RollbackReason,
)
from changefeed.limits import FAILOVER_LOG_ENTRIES_MAX, SEQNO_MAX, VB_UUID_BITS

U1, U2, U3, U4, U_UNKNOWN = 0x1111, 0x2222, 0x3333, 0x4444, 0x9999

NONE_BASE = RollbackReason.BASE_CASE
NONE_NEEDED = RollbackReason.NONE_NEEDED
PURGE = RollbackReason.PURGE
DIVERGED = RollbackReason.DIVERGED
LEADING = RollbackReason.LEADING
MISMATCH = RollbackReason.SNAPSHOT_MISMATCH


class _ScriptedRandom(random.Random):
    """Answers ``getrandbits(64)`` from a script, so a test chooses the uuids drawn."""

    def __init__(self, draws: list[int]) -> None:
        super().__init__(0)
        self.draws = list(draws)

    def getrandbits(self, k: int) -> int:
        assert k == 64, k
        return self.draws.pop(0)


def _draw_for(vb_uuid: int) -> int:
    """The 64-bit draw that create_entry turns into ``vb_uuid`` (it keeps the top 48 bits)."""
    return vb_uuid << (64 - VB_UUID_BITS)


def _producer() -> FailoverLog:
    """Branches: U1 from 0, U2 from 20, U3 from 30 (newest)."""
    log = FailoverLog([(U3, 30), (U2, 20), (U1, 0)])
    log._check_invariants()
    return log


def _request(
    log: FailoverLog,
    start: int,
    vb_uuid: int,
    snap: tuple[int, int],
    *,
    high: int = 40,
    purge: int = 0,
    strict: bool = False,
    client_purge: int | None = None,
    ignore_purged: bool = False,
) -> RollbackDecision:
    before = log.entries
    decision = log.needs_rollback(
        start,
        vb_uuid,
        snap[0],
        snap[1],
        high,
        purge,
        strict_vb_uuid=strict,
        client_purge_seqno=client_purge,
        ignore_purged_tombstones=ignore_purged,
    )
    assert log.entries == before, "needs_rollback must not change the log"
    return decision


# -- construction and validation -----------------------------------------------------------------


def test_constructor_keeps_entries_newest_first() -> None:
    log = _producer()
    assert log.entries == [(U3, 30), (U2, 20), (U1, 0)]
    assert log.latest == (U3, 30)
    assert len(log) == 3
    assert log.capacity == FAILOVER_LOG_ENTRIES_MAX


def test_equal_seqnos_are_allowed() -> None:
    # Two promotions with no write in between give two entries at the same seqno.
    log = FailoverLog([(U2, 10), (U1, 10)])
    log._check_invariants()
    assert log.entries == [(U2, 10), (U1, 10)]


def test_peer_uuids_may_use_all_64_bits() -> None:
    log = FailoverLog([(VB_UUID_WIRE_MAX, 5), (VB_UUID_CREATED_MAX + 1, 0)])
    log._check_invariants()
    assert log.latest == (VB_UUID_WIRE_MAX, 5)


def test_capacity_sized_log_is_accepted() -> None:
    entries = [(100 + i, 50 - i) for i in range(FAILOVER_LOG_ENTRIES_MAX)]
    assert len(FailoverLog(entries)) == FAILOVER_LOG_ENTRIES_MAX


BAD_ENTRIES = [
    pytest.param([], "empty", id="empty"),
    pytest.param([(i + 1, 0) for i in range(4)], "capacity 3", id="over-capacity"),
    pytest.param([(0, 5)], "non-zero", id="uuid-zero"),
    pytest.param([(2**64, 5)], "non-zero u64", id="uuid-over-u64"),
    pytest.param([(-1, 5)], "non-zero u64", id="uuid-negative"),
    pytest.param([(U1, -1)], "not a u64", id="seqno-negative"),
    pytest.param([(U1, 2**64)], "not a u64", id="seqno-over-u64"),
    pytest.param([(U1, 10**5000)], "16610-bit integer", id="seqno-with-5000-digits"),
    pytest.param([(U1, 10), (U2, 20)], "newest first", id="seqno-increasing"),
    pytest.param([(U1, 20), (U1, 10)], "twice", id="uuid-duplicate"),
    pytest.param([(True, 10)], "non-integer", id="uuid-bool"),
    pytest.param([(U1, 1.0)], "non-integer", id="seqno-float"),
    pytest.param([(U1, "10")], "non-integer", id="seqno-string"),
    pytest.param([(U1,)], "pair", id="entry-too-short"),
    pytest.param([(U1, 1, 2)], "pair", id="entry-too-long"),
    pytest.param([U1], "pair", id="entry-not-a-pair"),
    pytest.param("[[1, 2]]", "list", id="entries-a-string"),
    pytest.param({U1: 0}, "list", id="entries-a-dict"),
]


@pytest.mark.parametrize(("entries", "message"), BAD_ENTRIES)
def test_constructor_rejects_bad_entries(entries: object, message: str) -> None:
    with pytest.raises(FailoverLogError, match=message):
        FailoverLog(entries, capacity=3)  # type: ignore[arg-type]


def test_failover_log_error_is_a_value_error() -> None:
    assert issubclass(FailoverLogError, ValueError)


@pytest.mark.parametrize("capacity", [0, -1, FAILOVER_LOG_ENTRIES_MAX + 1])
def test_capacity_out_of_range_is_a_value_error(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        FailoverLog([(U1, 0)], capacity)


def test_capacity_must_be_an_int() -> None:
    with pytest.raises(TypeError, match="capacity"):
        FailoverLog([(U1, 0)], True)


def test_fresh_log_has_one_entry_at_seqno_zero() -> None:
    seed = 20240601
    print("seed", seed)
    log = FailoverLog.fresh(4, rng=random.Random(seed))
    log._check_invariants()
    assert len(log) == 1
    assert log.latest[1] == 0
    assert 0 < log.latest[0] <= VB_UUID_CREATED_MAX
    assert log.capacity == 4
    assert FailoverLog.fresh(4, rng=random.Random(seed)) == log  # replayable from the seed


def test_fresh_log_without_rng_uses_system_randomness() -> None:
    log = FailoverLog.fresh()
    log._check_invariants()
    assert 0 < log.latest[0] <= VB_UUID_CREATED_MAX


# -- reading -------------------------------------------------------------------------------------


def test_entries_is_a_copy() -> None:
    log = _producer()
    entries = log.entries
    entries.clear()
    assert len(log) == 3


def test_equality_and_repr() -> None:
    assert _producer() == _producer()
    assert _producer() != FailoverLog([(U3, 30), (U2, 20), (U1, 0)], capacity=3)
    assert _producer() != FailoverLog([(U3, 30)])
    assert _producer() != [(U3, 30), (U2, 20), (U1, 0)]
    assert repr(FailoverLog([(1, 2)], 3)) == "FailoverLog([(1, 2)], capacity=3)"
    with pytest.raises(TypeError):
        hash(_producer())


def test_entry_for_rollback_is_newest_entry_at_or_below() -> None:
    log = _producer()
    assert log.entry_for_rollback(40) == (U3, 30)
    assert log.entry_for_rollback(30) == (U3, 30)
    assert log.entry_for_rollback(29) == (U2, 20)
    assert log.entry_for_rollback(20) == (U2, 20)
    assert log.entry_for_rollback(0) == (U1, 0)


def test_entry_for_rollback_below_every_entry_is_a_lookup_error() -> None:
    log = FailoverLog([(U2, 20), (U1, 10)])
    with pytest.raises(LookupError, match="prune_after"):
        log.entry_for_rollback(9)


# -- create_entry --------------------------------------------------------------------------------


def test_create_entry_pushes_a_new_branch_in_front() -> None:
    log = FailoverLog([(U1, 0)], rng=_ScriptedRandom([_draw_for(U2)]))
    assert log.create_entry(15) == U2
    log._check_invariants()
    assert log.entries == [(U2, 15), (U1, 0)]


def test_create_entry_drops_entries_above_high_seqno() -> None:
    log = FailoverLog([(U3, 30), (U2, 20), (U1, 0)], rng=_ScriptedRandom([_draw_for(U4)]))
    assert log.create_entry(25) == U4
    log._check_invariants()
    assert log.entries == [(U4, 25), (U2, 20), (U1, 0)]


def test_create_entry_keeps_an_entry_at_exactly_high_seqno() -> None:
    log = FailoverLog([(U3, 30), (U2, 20), (U1, 0)], rng=_ScriptedRandom([_draw_for(U4)]))
    log.create_entry(20)
    assert log.entries == [(U4, 20), (U2, 20), (U1, 0)]


def test_create_entry_below_every_entry_leaves_only_the_new_one() -> None:
    log = FailoverLog([(U3, 30), (U2, 20)], rng=_ScriptedRandom([_draw_for(U4)]))
    log.create_entry(5)
    log._check_invariants()
    assert log.entries == [(U4, 5)]


def test_capacity_drops_the_oldest_entry() -> None:
    log = FailoverLog([(U3, 30), (U2, 20), (U1, 0)], 3, rng=_ScriptedRandom([_draw_for(U4)]))
    log.create_entry(40)
    log._check_invariants()
    assert log.entries == [(U4, 40), (U3, 30), (U2, 20)]


def test_capacity_one_keeps_only_the_newest() -> None:
    log = FailoverLog([(U1, 0)], 1, rng=_ScriptedRandom([_draw_for(U2), _draw_for(U3)]))
    log.create_entry(10)
    log.create_entry(20)
    log._check_invariants()
    assert log.entries == [(U3, 20)]


def test_drops_for_capacity_happen_after_drops_for_divergence() -> None:
    # Dropping newer entries first frees room, so no old entry is lost needlessly.
    log = FailoverLog([(U3, 30), (U2, 20), (U1, 0)], 3, rng=_ScriptedRandom([_draw_for(U4)]))
    log.create_entry(25)
    assert log.entries == [(U4, 25), (U2, 20), (U1, 0)]


def test_create_entry_skips_zero_and_taken_uuids() -> None:
    # Draw 1 is 0; draw 2 is in the log; draw 3 belongs to the entry this call drops (a
    # consumer still on that branch must not match the new one); draw 4 is free.
    draws = [0, _draw_for(U1), _draw_for(U3), _draw_for(U4)]
    rng = _ScriptedRandom(draws)
    log = FailoverLog([(U3, 30), (U1, 0)], rng=rng)
    assert log.create_entry(10) == U4
    assert rng.draws == []
    assert log.entries == [(U4, 10), (U1, 0)]


def test_create_entry_keeps_the_top_48_bits_of_a_draw() -> None:
    log = FailoverLog([(U1, 0)], rng=_ScriptedRandom([2**64 - 1]))
    assert log.create_entry(1) == 2**48 - 1


def test_broken_rng_is_a_runtime_error_and_leaves_the_log_alone() -> None:
    log = FailoverLog([(U2, 20), (U1, 0)], rng=_ScriptedRandom([0] * 100))
    with pytest.raises(RuntimeError, match="rng"):
        log.create_entry(10)
    assert log.entries == [(U2, 20), (U1, 0)]


def test_new_uuids_are_non_zero_48_bit_and_unique_over_many_draws() -> None:
    seed = 7_340_033
    print("seed", seed)
    log = FailoverLog([(U1, 0)], rng=random.Random(seed))
    drawn = []
    for seqno in range(1, 5001):
        in_log_before = {vb_uuid for vb_uuid, _ in log.entries}
        vb_uuid = log.create_entry(seqno)
        assert 0 < vb_uuid <= VB_UUID_CREATED_MAX, vb_uuid
        assert vb_uuid not in in_log_before
        log._check_invariants()
        drawn.append(vb_uuid)
    assert len(set(drawn)) == len(drawn)
    # All 48 bits are used: 5000 draws never reaching 2**47 would mean a narrower range.
    assert max(drawn) >= 2**47
    assert len(log) == FAILOVER_LOG_ENTRIES_MAX


def test_same_seed_gives_same_uuids() -> None:
    seed = 99
    print("seed", seed)
    first = FailoverLog([(U1, 0)], rng=random.Random(seed))
    second = FailoverLog([(U1, 0)], rng=random.Random(seed))
    assert [first.create_entry(s) for s in range(5)] == [second.create_entry(s) for s in range(5)]


@pytest.mark.parametrize("bad", [-1, 2**64])
def test_create_entry_rejects_out_of_range_seqno(bad: int) -> None:
    with pytest.raises(ValueError, match="high_seqno"):
        _producer().create_entry(bad)


# -- prune_after, replace ------------------------------------------------------------------------


def test_prune_after_drops_entries_above_seqno() -> None:
    log = _producer()
    log.prune_after(25)
    log._check_invariants()
    assert log.entries == [(U2, 20), (U1, 0)]


def test_prune_after_keeps_entry_at_exactly_seqno() -> None:
    log = _producer()
    log.prune_after(20)
    assert log.entries == [(U2, 20), (U1, 0)]


def test_prune_after_above_every_entry_changes_nothing() -> None:
    log = _producer()
    log.prune_after(1000)
    assert log.entries == [(U3, 30), (U2, 20), (U1, 0)]


def test_prune_after_that_empties_the_log_creates_an_entry_at_seqno() -> None:
    # The new uuid also avoids the uuids being dropped (draw 1 is U2's).
    rng = _ScriptedRandom([_draw_for(U2), _draw_for(U4)])
    log = FailoverLog([(U3, 30), (U2, 20)], rng=rng)
    log.prune_after(7)
    log._check_invariants()
    assert log.entries == [(U4, 7)]


def test_replace_takes_the_producers_log() -> None:
    log = FailoverLog([(U1, 0)], 3)
    log.replace([(U3, 30), (U2, 20)])
    log._check_invariants()
    assert log.entries == [(U3, 30), (U2, 20)]


@pytest.mark.parametrize(("entries", "message"), BAD_ENTRIES)
def test_replace_with_bad_entries_leaves_the_log_unchanged(entries: object, message: str) -> None:
    log = FailoverLog([(U4, 40)], 3)
    with pytest.raises(FailoverLogError, match=message):
        log.replace(entries)  # type: ignore[arg-type]
    assert log.entries == [(U4, 40)]


# -- JSON ----------------------------------------------------------------------------------------


def test_json_round_trip() -> None:
    log = FailoverLog([(VB_UUID_WIRE_MAX, SEQNO_MAX), (U2, 20), (U1, 0)], 5)
    text = log.to_json()
    assert json.loads(text) == [[VB_UUID_WIRE_MAX, SEQNO_MAX], [U2, 20], [U1, 0]]
    again = FailoverLog.from_json(text, 5)
    again._check_invariants()
    assert again == log


def test_list_round_trip_inside_a_bigger_document() -> None:
    log = _producer()
    document = json.dumps({"vb": 7, "failover_log": log.to_list(), "seqno": 35})
    again = FailoverLog.from_list(json.loads(document)["failover_log"])
    assert again == log


def test_json_accepts_whitespace() -> None:
    log = FailoverLog([(VB_UUID_WIRE_MAX - i, SEQNO_MAX - i) for i in range(25)])
    text = json.dumps(log.to_list(), indent=4)
    assert FailoverLog.from_json(text) == log


MALFORMED_JSON = [
    pytest.param("", "not valid JSON", id="empty-text"),
    pytest.param("[[1, 2]", "not valid JSON", id="truncated"),
    pytest.param("{'a': 1}", "not valid JSON", id="single-quotes"),
    pytest.param("null", "list", id="null"),
    pytest.param('{"entries": [[1, 2]]}', "list", id="object"),
    pytest.param("[]", "empty", id="empty-list"),
    pytest.param("[[1, 2], [3]]", "pair", id="short-pair"),
    pytest.param("[[1, 2, 3]]", "pair", id="long-pair"),
    pytest.param("[1, 2]", "pair", id="flat"),
    pytest.param('[["1", 2]]', "non-integer", id="string-uuid"),
    pytest.param("[[1, 2.5]]", "non-integer", id="float-seqno"),
    pytest.param("[[1, 2e3]]", "non-integer", id="exponent-seqno"),
    pytest.param("[[true, 2]]", "non-integer", id="bool-uuid"),
    pytest.param("[[1, NaN]]", "non-integer", id="nan-seqno"),
    pytest.param("[[1, null]]", "non-integer", id="null-seqno"),
    pytest.param("[[0, 2]]", "non-zero", id="zero-uuid"),
    pytest.param(f"[[{2**64}, 2]]", "non-zero u64", id="uuid-over-u64"),
    pytest.param("[[1, -2]]", "not a u64", id="negative-seqno"),
    pytest.param("[[1, 2], [3, 4]]", "newest first", id="oldest-first"),
    pytest.param("[[1, 4], [1, 2]]", "twice", id="duplicate-uuid"),
    pytest.param(json.dumps([[i + 1, 0] for i in range(26)]), "capacity", id="26-entries"),
    pytest.param("[" * 2200 + "]" * 2200, "too deeply", id="deep-nesting"),
    pytest.param("[[1, " + "9" * 4400 + "]]", "not valid JSON", id="huge-integer"),
    pytest.param(" " * 5000 + "[[1, 2]]", "characters", id="too-long"),
]


@pytest.mark.parametrize(("text", "message"), MALFORMED_JSON)
def test_malformed_json_is_a_failover_log_error(text: str, message: str) -> None:
    with pytest.raises(FailoverLogError, match=message):
        FailoverLog.from_json(text)


def test_from_json_needs_a_str() -> None:
    with pytest.raises(TypeError, match="str"):
        FailoverLog.from_json(b"[[1, 2]]")  # type: ignore[arg-type]


def test_from_json_respects_capacity() -> None:
    with pytest.raises(FailoverLogError, match="capacity 2"):
        FailoverLog.from_json("[[3, 3], [2, 2], [1, 1]]", 2)


@st.composite
def valid_entries(
    draw: st.DrawFn, capacity: int = FAILOVER_LOG_ENTRIES_MAX, seqno_max: int = SEQNO_MAX
) -> list[tuple[int, int]]:
    size = draw(st.integers(1, capacity))
    uuids = draw(
        st.lists(st.integers(1, VB_UUID_WIRE_MAX), min_size=size, max_size=size, unique=True)
    )
    seqnos = draw(st.lists(st.integers(0, seqno_max), min_size=size, max_size=size))
    return list(zip(uuids, sorted(seqnos, reverse=True), strict=True))


@given(valid_entries())
def test_json_round_trip_property(entries: list[tuple[int, int]]) -> None:
    log = FailoverLog(entries)
    assert FailoverLog.from_json(log.to_json()) == log
    assert FailoverLog.from_list(json.loads(json.dumps(log.to_list()))) == log
    assert FailoverLog.from_json(log.to_json()).entries == entries


@given(valid_entries(), st.data())
def test_any_out_of_order_log_is_rejected(
    entries: list[tuple[int, int]], data: st.DataObject
) -> None:
    reordered = data.draw(st.permutations(entries))
    seqnos = [seqno for _, seqno in reordered]
    assume(seqnos != sorted(seqnos, reverse=True))
    with pytest.raises(FailoverLogError, match="newest first"):
        FailoverLog(reordered)


# -- log operations against a list model ---------------------------------------------------------


@settings(max_examples=300)
@given(
    st.integers(1, 6).flatmap(
        lambda capacity: st.tuples(st.just(capacity), valid_entries(capacity, seqno_max=40))
    ),
    st.lists(st.tuples(st.sampled_from(["create", "prune"]), st.integers(0, 50)), max_size=30),
    st.integers(0, 2**32),
)
def test_log_operations_match_a_list_model(
    capacity_and_entries: tuple[int, list[tuple[int, int]]],
    operations: list[tuple[str, int]],
    seed: int,
) -> None:
    capacity, entries = capacity_and_entries
    log = FailoverLog(entries, capacity, rng=random.Random(seed))
    model = list(entries)
    for operation, seqno in operations:
        before = {vb_uuid for vb_uuid, _ in model}
        if operation == "create":
            vb_uuid = log.create_entry(seqno)
            assert 0 < vb_uuid <= VB_UUID_CREATED_MAX
            assert vb_uuid not in before
            model = ([(vb_uuid, seqno)] + [e for e in model if e[1] <= seqno])[:capacity]
        else:
            log.prune_after(seqno)
            kept = [e for e in model if e[1] <= seqno]
            if not kept:
                assert log.latest[1] == seqno
                assert log.latest[0] not in before
                assert 0 < log.latest[0] <= VB_UUID_CREATED_MAX
                kept = [log.latest]
            model = kept
            assert log.entry_for_rollback(seqno) == model[0]
        log._check_invariants()
        assert log.entries == model


# -- needs_rollback: named examples, one per rule ------------------------------------------------


def test_rule0_start_equal_snap_end_means_the_whole_snapshot_is_held() -> None:
    # Snapshot [25, 35] fully held: treated as [35, 35]; upper(U2) = 30 < 35 rolls back to 30.
    # Without normalisation 25 <= 30 < 35 would answer snap_start (25).
    assert _request(_producer(), 35, U2, (25, 35)) == RollbackDecision(True, 30, LEADING)


def test_rule0_start_equal_snap_start_means_none_of_the_snapshot_is_held() -> None:
    # Snapshot [25, 35] with nothing held: treated as [25, 25], inside U2's history (upper 30).
    # Without normalisation it would roll back to 25.
    assert _request(_producer(), 25, U2, (25, 35)) == RollbackDecision(False, 25, NONE_NEEDED)


@pytest.mark.parametrize("strict", [False, True])
def test_rule1_start_zero_and_uuid_zero_never_rolls_back(strict: bool) -> None:
    decision = _request(_producer(), 0, 0, (0, 10), strict=strict, purge=5)
    assert decision == RollbackDecision(False, 0, NONE_BASE)


def test_rule1_start_zero_with_unknown_uuid_is_not_checked_without_strict() -> None:
    assert _request(_producer(), 0, U_UNKNOWN, (0, 0)) == RollbackDecision(False, 0, NONE_BASE)


def test_rule1_start_zero_with_unknown_uuid_rolls_back_to_zero_when_strict() -> None:
    decision = _request(_producer(), 0, U_UNKNOWN, (0, 0), strict=True)
    assert decision == RollbackDecision(True, 0, DIVERGED)


def test_rule1_start_zero_with_known_uuid_passes_the_strict_check() -> None:
    decision = _request(_producer(), 0, U1, (0, 7), strict=True)
    assert decision == RollbackDecision(False, 0, NONE_NEEDED)


def test_rule1_start_zero_skips_the_purge_rule_even_when_strict() -> None:
    decision = _request(_producer(), 0, U3, (0, 0), strict=True, purge=10)
    assert decision == RollbackDecision(False, 0, NONE_NEEDED)


def test_rule2_start_behind_purge_seqno_rolls_back_to_zero() -> None:
    # U1's history covers [5, 5] (upper 20); only the purge rule can roll it back.
    assert _request(_producer(), 5, U1, (5, 5), purge=10) == RollbackDecision(True, 0, PURGE)


def test_rule2_applies_before_the_uuid_checks() -> None:
    decision = _request(_producer(), 5, U_UNKNOWN, (5, 5), purge=10)
    assert decision == RollbackDecision(True, 0, PURGE)


def test_rule2_start_equal_to_purge_seqno_does_not_roll_back() -> None:
    assert _request(_producer(), 10, U1, (10, 10), purge=10).rollback is False


def test_rule2_compares_start_not_snap_start() -> None:
    # Reference §14 errata: the seed says snap_start < purge; the code compares start.
    decision = _request(_producer(), 12, U1, (5, 15), purge=10)
    assert decision == RollbackDecision(False, 12, NONE_NEEDED)


def test_rule2_waived_by_ignore_purged_tombstones() -> None:
    decision = _request(_producer(), 5, U1, (5, 5), purge=10, ignore_purged=True)
    assert decision == RollbackDecision(False, 5, NONE_NEEDED)


def test_rule2_waived_when_the_client_saw_this_purge_seqno() -> None:
    decision = _request(_producer(), 5, U1, (5, 5), purge=10, client_purge=10)
    assert decision == RollbackDecision(False, 5, NONE_NEEDED)


def test_rule2_not_waived_when_the_client_saw_an_older_purge_seqno() -> None:
    decision = _request(_producer(), 5, U1, (5, 5), purge=10, client_purge=9)
    assert decision == RollbackDecision(True, 0, PURGE)


def test_rule2_waived_then_uuid_checks_still_apply() -> None:
    decision = _request(_producer(), 5, U_UNKNOWN, (5, 5), purge=10, ignore_purged=True)
    assert decision == RollbackDecision(True, 0, DIVERGED)


def test_rule3_unknown_uuid_rolls_back_to_zero() -> None:
    assert _request(_producer(), 15, U_UNKNOWN, (10, 20)) == RollbackDecision(True, 0, DIVERGED)


def test_rule3_uuid_zero_with_a_non_zero_start_rolls_back_to_zero() -> None:
    assert _request(_producer(), 15, 0, (15, 15)) == RollbackDecision(True, 0, DIVERGED)


def test_rule3_uuid_dropped_for_capacity_rolls_back_to_zero() -> None:
    log = FailoverLog([(U1, 0)], 2, rng=_ScriptedRandom([_draw_for(U2), _draw_for(U3)]))
    log.create_entry(10)
    log.create_entry(20)
    assert _request(log, 5, U1, (5, 5)) == RollbackDecision(True, 0, DIVERGED)


def test_rule4_newest_uuid_uses_high_seqno_as_upper() -> None:
    log = _producer()
    assert _request(log, 40, U3, (35, 40), high=40) == RollbackDecision(False, 40, NONE_NEEDED)
    assert _request(log, 40, U3, (35, 40), high=38) == RollbackDecision(True, 38, LEADING)


def test_rule4_older_uuid_uses_the_next_newer_entry_as_upper() -> None:
    # U1 is shared up to 20 (where U2 began), not up to 30 (U3) or 40 (high seqno).
    assert _request(_producer(), 25, U1, (25, 25)) == RollbackDecision(True, 20, LEADING)
    assert _request(_producer(), 20, U1, (20, 20)) == RollbackDecision(False, 20, NONE_NEEDED)


def test_rule4a_lagging_consumer_does_not_roll_back() -> None:
    assert _request(_producer(), 24, U2, (22, 28)) == RollbackDecision(False, 24, NONE_NEEDED)


def test_rule4a_snap_end_equal_to_upper_does_not_roll_back() -> None:
    assert _request(_producer(), 27, U2, (25, 30)) == RollbackDecision(False, 27, NONE_NEEDED)


def test_rule4b_leading_consumer_rolls_back_to_upper() -> None:
    assert _request(_producer(), 35, U2, (32, 38)) == RollbackDecision(True, 30, LEADING)


def test_rule4b_consumer_ahead_of_high_seqno_is_decided_not_rejected() -> None:
    # The producer rejects start > high with ERANGE only after the rollback check (§6.2).
    assert _request(_producer(), 50, U3, (45, 50)) == RollbackDecision(True, 40, LEADING)


def test_rule4c_snapshot_mismatch_rolls_back_to_snap_start() -> None:
    assert _request(_producer(), 28, U2, (25, 35)) == RollbackDecision(True, 25, MISMATCH)


def test_rule4c_snap_start_equal_to_upper_rolls_back_to_snap_start() -> None:
    assert _request(_producer(), 32, U2, (30, 35)) == RollbackDecision(True, 30, MISMATCH)


def test_old_active_rejoins_after_failover() -> None:
    # The old active wrote 21..35 on U2; a replica holding 28 was promoted (U4 from 28) and the
    # old active now asks it for more. It rolls back to 28, keeps U2 (its entry is at 20), and
    # its second request succeeds; then it takes the new active's log.
    new_active = FailoverLog([(U4, 28), (U2, 20), (U1, 0)])
    old_active = FailoverLog([(U2, 20), (U1, 0)])
    first = _request(new_active, 35, old_active.latest[0], (30, 35), high=33)
    assert first == RollbackDecision(True, 28, LEADING)
    old_active.prune_after(first.seqno)
    vb_uuid, _ = old_active.entry_for_rollback(first.seqno)
    assert vb_uuid == U2
    second = _request(new_active, 28, vb_uuid, (28, 28), high=33)
    assert second == RollbackDecision(False, 28, NONE_NEEDED)
    old_active.replace(new_active.entries)
    assert old_active.latest == (U4, 28)


BAD_REQUESTS = [
    pytest.param(dict(start=9, snap=(10, 20)), ValueError, "ERANGE", id="start-below-snap-start"),
    pytest.param(dict(start=21, snap=(10, 20)), ValueError, "ERANGE", id="start-above-snap-end"),
    pytest.param(dict(start=5, snap=(10, 0)), ValueError, "ERANGE", id="snapshot-reversed"),
    pytest.param(dict(start=-1, snap=(0, 0)), ValueError, "start_seqno", id="negative-start"),
    pytest.param(dict(start=2**64, snap=(0, 2**64)), ValueError, "start_seqno", id="huge-start"),
    pytest.param(dict(high=10**5000), ValueError, "-bit integer", id="high-with-5000-digits"),
    pytest.param(dict(vb_uuid=2**64), ValueError, "vb_uuid", id="huge-uuid"),
    pytest.param(dict(vb_uuid=-1), ValueError, "vb_uuid", id="negative-uuid"),
    pytest.param(dict(high=-1), ValueError, "high_seqno", id="negative-high"),
    pytest.param(dict(purge=41), ValueError, "purge_seqno 41 > high_seqno", id="purge-over-high"),
    pytest.param(dict(purge=-1), ValueError, "purge_seqno", id="negative-purge"),
    pytest.param(dict(client_purge=-1), ValueError, "client_purge_seqno", id="bad-client-purge"),
    pytest.param(dict(start=True, snap=(0, 1)), TypeError, "start_seqno", id="bool-start"),
    pytest.param(dict(vb_uuid=1.5), TypeError, "vb_uuid", id="float-uuid"),
]


@pytest.mark.parametrize(("changes", "error", "message"), BAD_REQUESTS)
def test_bad_requests_are_the_callers_error(
    changes: dict[str, object], error: type[Exception], message: str
) -> None:
    arguments: dict[str, object] = dict(start=15, vb_uuid=U2, snap=(10, 20), high=40, purge=0)
    arguments.update(changes)
    with pytest.raises(error, match=message):
        _request(
            _producer(),
            arguments["start"],  # type: ignore[arg-type]
            arguments["vb_uuid"],  # type: ignore[arg-type]
            arguments["snap"],  # type: ignore[arg-type]
            high=arguments["high"],  # type: ignore[arg-type]
            purge=arguments["purge"],  # type: ignore[arg-type]
            client_purge=arguments.get("client_purge"),  # type: ignore[arg-type]
        )


def test_rollback_decision_is_a_frozen_slotted_value() -> None:
    decision = RollbackDecision(True, 30, LEADING)
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.seqno = 31  # type: ignore[misc]
    assert not hasattr(decision, "__dict__")
    assert decision == RollbackDecision(True, 30, LEADING)


@pytest.mark.parametrize(
    ("rollback", "seqno", "reason"),
    [
        (True, 0, NONE_NEEDED),
        (False, 0, DIVERGED),
        (True, 5, PURGE),
        (True, 5, DIVERGED),
        (True, -1, LEADING),
        (False, 2**64, NONE_BASE),
    ],
)
def test_rollback_decision_rejects_contradictions(
    rollback: bool, seqno: int, reason: RollbackReason
) -> None:
    with pytest.raises(ValueError):
        RollbackDecision(rollback, seqno, reason)


@given(
    valid_entries(seqno_max=60),
    st.integers(0, 60),
    st.integers(0, 60),
    st.integers(0, 60),
    st.booleans(),
    st.booleans(),
    st.data(),
)
def test_decision_bounds_on_arbitrary_requests(
    entries: list[tuple[int, int]],
    seqno_a: int,
    seqno_b: int,
    seqno_c: int,
    strict: bool,
    ignore_purged: bool,
    data: st.DataObject,
) -> None:
    log = FailoverLog(entries)
    # Any log, any well-formed request: the decision stays within the request and the log.
    snap_start, start, snap_end = sorted((seqno_a, seqno_b, seqno_c))
    producer_high = data.draw(st.integers(0, 80))
    purge = data.draw(st.integers(0, producer_high))
    known = [vb_uuid for vb_uuid, _ in entries]
    unknown = next(candidate for candidate in itertools.count(1) if candidate not in known)
    vb_uuid = data.draw(st.sampled_from([0, unknown, *known]))
    decision = _request(
        log,
        start,
        vb_uuid,
        (snap_start, snap_end),
        high=producer_high,
        purge=purge,
        strict=strict,
        ignore_purged=ignore_purged,
    )
    assert decision.seqno <= start
    if not decision.rollback:
        assert decision.seqno == start
    if decision.reason is DIVERGED:
        assert vb_uuid not in known
    if decision.reason in (LEADING, MISMATCH):
        assert vb_uuid in known
        assert decision.seqno in {snap_start, producer_high, *(s for _, s in entries)}


# -- needs_rollback against a model of history ---------------------------------------------------

# Model uuids start above anything create_entry draws, so a uuid the implementation makes in
# prune_after can never collide with a model branch.
_MODEL_UUID_BASE = VB_UUID_CREATED_MAX + 1

# Requests a consumer following the client rules needs at most. Two facts of any pair of logs
# that share an entry E make the bound small: E's seqno is the same in both, and so are the
# entries just below E (they are whatever the log that created E held then; later changes only
# add above or drop the oldest). Request 1 ends, rolls back to 0 (request 2 at 0 passes: rule 1,
# and a strict consumer sends uuid 0), or rolls back to r with r at least the seqno of the entry
# E it sent (leading: r = upper) or to its snapshot start (mismatch). At r the consumer sends E
# again, or, if pruning removed E, the entry just below E, whose upper at the producer is E's
# seqno > r. Either way request 2 passes unless the purge rule or a pruned-away uuid sends it to
# 0, and request 3 at 0 passes.
_REQUESTS_MAX = 3


@dataclass
class _Node:
    """One copy of a vbucket in the model.

    ``data[k - 1]`` names the branch whose active wrote seqno k; two nodes hold the same
    mutation at k exactly when they name the same branch there, because only the node that
    created a branch writes on it. ``log`` is the node's failover log, OLDEST first (the model's
    own order; the class keeps newest first).
    """

    data: list[int]
    log: list[tuple[int, int]]
    writer: bool  # this node created its newest branch and may write on it


def _model_branch(node: _Node, seqno: int, vb_uuid: int, capacity: int) -> None:
    # A vbucket becomes active at `seqno` (its high seqno, or below it after an unclean
    # shutdown): entries above `seqno` go, the new one is appended, the oldest beyond capacity go.
    node.log = [entry for entry in node.log if entry[1] <= seqno] + [(vb_uuid, seqno)]
    del node.log[: max(0, len(node.log) - capacity)]
    node.writer = True


def _common_history(first: list[int], second: list[int]) -> int:
    """The last seqno up to which both nodes hold the same mutations."""
    for index, (mine, theirs) in enumerate(zip(first, second, strict=False)):
        if mine != theirs:
            return index
    return min(len(first), len(second))


def _evolve(
    draw: st.DrawFn, node: _Node, fresh: itertools.count[int], capacity: int, writes: int = 1
) -> tuple[int, list[int]]:
    """Apply random writes and promotions (``writes`` to 1 is their ratio); return the step
    count and the branch seqnos."""
    branch_seqnos = []
    steps = draw(st.integers(0, 5))
    for _ in range(steps):
        high = len(node.data)
        if draw(st.sampled_from(["write"] * writes + ["branch"])) == "write":
            if not node.writer:  # a copy must be promoted (at its high seqno) before writing
                _model_branch(node, high, next(fresh), capacity)
                branch_seqnos.append(high)
            node.data.extend([node.log[-1][0]] * draw(st.integers(1, 6)))
        else:
            seqno = draw(st.one_of(st.just(high), st.integers(0, high)))
            _model_branch(node, seqno, next(fresh), capacity)
            branch_seqnos.append(seqno)
    return steps, branch_seqnos


@dataclass
class _Scenario:
    producer: _Node
    consumer: _Node
    capacity: int
    start: int
    snap_start: int
    snap_end: int
    vb_uuid: int
    purge: int
    client_purge: int | None
    ignore_purged: bool
    strict: bool
    plain_lag: bool  # consumer is an untouched lagging copy; producer branched at or above it
    seed: int

    def producer_log(self) -> FailoverLog:
        return FailoverLog(list(reversed(self.producer.log)), self.capacity)

    def consumer_log(self) -> FailoverLog:
        rng = random.Random(self.seed)
        return FailoverLog(list(reversed(self.consumer.log)), self.capacity, rng=rng)

    def purge_waived(self) -> bool:
        return self.ignore_purged or self.client_purge == self.purge


@st.composite
def scenarios(draw: st.DrawFn) -> _Scenario:
    """A common ancestor, then a lagging copy and the original evolving apart (or not)."""
    # Small capacities make branches fall off the log; the real one keeps most of them.
    capacity = draw(st.sampled_from([1, 2, 3, 5, *[FAILOVER_LOG_ENTRIES_MAX] * 3]))
    fresh = itertools.count(_MODEL_UUID_BASE + 1)
    root = next(fresh)
    ancestor = _Node(data=[root] * draw(st.integers(0, 6)), log=[(root, 0)], writer=True)
    _evolve(draw, ancestor, fresh, capacity)
    fork = len(ancestor.data) - draw(st.integers(0, len(ancestor.data)))
    # The copy got the ancestor's log when it last connected: either all of it (entries may lie
    # above what it holds) or as a consumer pruned to what it holds.
    pruned_log = [entry for entry in ancestor.log if entry[1] <= fork]
    full_log = draw(st.booleans()) or not pruned_log
    copy = _Node(ancestor.data[:fork], list(ancestor.log) if full_log else pruned_log, False)
    original = _Node(list(ancestor.data), list(ancestor.log), ancestor.writer)
    consumer_lags = draw(st.booleans())
    producer, consumer = (original, copy) if consumer_lags else (copy, original)
    _, producer_branches = _evolve(draw, producer, fresh, capacity)
    # Half the consumers stay as they were, and the others mostly write rather than branch, so
    # that shared uuids (rule 4) are common.
    consumer_steps = 0
    if draw(st.booleans()):
        consumer_steps = _evolve(draw, consumer, fresh, capacity, writes=3)[0]
    snap_end = len(consumer.data)
    # Snapshots both wide and narrow: integers favour small draws, so draw from either end.
    offset = draw(st.integers(0, snap_end))
    snap_start = offset if draw(st.booleans()) else snap_end - offset
    # The consumer holds the whole snapshot, none of it, or part of it, in even shares.
    held = draw(st.sampled_from(["whole", "none", "part"]))
    if held == "whole" or (held == "part" and snap_end - snap_start < 2):
        start = snap_end
    elif held == "none":
        start = snap_start
    else:
        start = snap_start + draw(st.integers(1, snap_end - snap_start - 1))
    # sampled_from draws evenly (integers favour their bounds): uuid 0 one time in eight.
    vb_uuid = consumer.log[-1][0] if draw(st.sampled_from([True] * 7 + [False])) else 0
    purge = draw(st.integers(0, len(producer.data)))
    known = {entry_uuid for entry_uuid, _ in producer.log}
    plain_lag = (
        consumer_lags
        and consumer_steps == 0
        and all(seqno >= fork for seqno in producer_branches)
        and consumer.log[-1][0] in known
    )
    return _Scenario(
        producer=producer,
        consumer=consumer,
        capacity=capacity,
        start=start,
        snap_start=snap_start,
        snap_end=snap_end,
        vb_uuid=vb_uuid,
        purge=purge,
        client_purge=draw(st.one_of(st.none(), st.just(purge), st.integers(0, purge + 1))),
        ignore_purged=draw(st.sampled_from([False] * 3 + [True])),
        strict=draw(st.booleans()),
        plain_lag=plain_lag,
        seed=draw(st.integers(0, 2**32)),
    )


def _ask(scenario: _Scenario, start: int, vb_uuid: int, snap: tuple[int, int]) -> RollbackDecision:
    return _request(
        scenario.producer_log(),
        start,
        vb_uuid,
        snap,
        high=len(scenario.producer.data),
        purge=scenario.purge,
        strict=scenario.strict,
        client_purge=scenario.client_purge,
        ignore_purged=scenario.ignore_purged,
    )


def _check_safe(
    scenario: _Scenario,
    consumer_data: list[int],
    request: tuple[int, int, int],
    decision: RollbackDecision,
) -> None:
    """Properties (1) and (2): judged on the model's data, never on failover entries."""
    start, snap_start, snap_end = request
    common = _common_history(scenario.producer.data, consumer_data)
    purge_applies = 0 < start < scenario.purge and not scenario.purge_waived()
    if decision.rollback:
        # (1) The consumer may keep only what it shares with the producer, and only up to a
        # point where its data is consistent: anywhere up to start once it holds its whole
        # snapshot, else no further than the snapshot's start, because deduplication leaves the
        # part of a snapshot it holds inconsistent (dcp-rollback.md, terms).
        consistent_to = start if start == snap_end else snap_start
        assert decision.seqno <= consistent_to, (decision, request)
        assert decision.seqno <= common, (decision, request, common)
        # A purge rollback is only justified for a consumer behind the purge seqno.
        if decision.reason is PURGE:
            assert purge_applies, (decision, request, scenario.purge)
        return
    # (2) Streaming on is only right if what the consumer holds is common history: all of it up
    # to start, and up to snap_end when it is inside a snapshot (deduplication means the rest of
    # that snapshot must come from the same history).
    held_to = start if start == snap_start else snap_end
    assert held_to <= common, (decision, request, common)
    assert decision.seqno == start
    assert not purge_applies, (decision, request, scenario.purge)


@settings(max_examples=1000, deadline=None)
@given(scenarios())
def test_rollback_point_is_within_common_history(scenario: _Scenario) -> None:
    request = (scenario.start, scenario.snap_start, scenario.snap_end)
    snap = (scenario.snap_start, scenario.snap_end)
    decision = _ask(scenario, scenario.start, scenario.vb_uuid, snap)
    _check_safe(scenario, scenario.consumer.data, request, decision)


@settings(max_examples=1000, deadline=None)
@given(scenarios())
def test_plainly_lagging_consumer_is_not_rolled_back(scenario: _Scenario) -> None:
    # Precision: a copy that only fell behind, asking a producer whose later branches all start
    # at or above what the copy holds, shares all it holds; only the purge rule may intervene.
    if not scenario.plain_lag or (scenario.vb_uuid == 0 and scenario.start != 0):
        return
    snap = (scenario.snap_start, scenario.snap_end)
    decision = _ask(scenario, scenario.start, scenario.vb_uuid, snap)
    purge_applies = 0 < scenario.start < scenario.purge and not scenario.purge_waived()
    assert decision.rollback is purge_applies, decision
    assert _common_history(scenario.producer.data, scenario.consumer.data) >= scenario.snap_end


@settings(max_examples=1000, deadline=None)
@given(scenarios())
def test_rerequesting_at_the_rollback_point_converges(scenario: _Scenario) -> None:
    # (3) The consumer follows the client rules of §9.1: drop data above the rollback seqno,
    # prune its log, re-request from the newest entry at or below it with snapshot [r, r]. A
    # strict consumer rolled back to 0 has no history worth checking and sends uuid 0.
    consumer_log = scenario.consumer_log()
    data = list(scenario.consumer.data)
    start, snap_start, snap_end = scenario.start, scenario.snap_start, scenario.snap_end
    vb_uuid = scenario.vb_uuid
    for _ in range(_REQUESTS_MAX):
        decision = _ask(scenario, start, vb_uuid, (snap_start, snap_end))
        _check_safe(scenario, data, (start, snap_start, snap_end), decision)
        if not decision.rollback:
            return
        rollback_seqno = decision.seqno
        del data[rollback_seqno:]
        consumer_log.prune_after(rollback_seqno)
        consumer_log._check_invariants()
        vb_uuid, entry_seqno = consumer_log.entry_for_rollback(rollback_seqno)
        assert (vb_uuid, entry_seqno) == consumer_log.latest
        assert entry_seqno <= rollback_seqno
        if scenario.strict and rollback_seqno == 0:
            vb_uuid = 0
        start = snap_start = snap_end = rollback_seqno
    pytest.fail(f"no agreement after {_REQUESTS_MAX} requests; last at {start}")
