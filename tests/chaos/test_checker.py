"""Unit tests of the chaos checker (``nemesis.checker``): each count is fed a history that
must trip it — a lost durable write, a divergent replica, a non-monotonic seqno, a stale or
missing key — and histories that look alarming but are allowed (ambiguous writes, losses of
non-durable writes, rollbacks, purged tombstones) must not."""

from __future__ import annotations

from nemesis.checker import (
    ChaosReport,
    Copy,
    StateCheck,
    WriteCheck,
    check_monotonic,
    check_replicas,
    check_state,
    check_writes,
    unexplained_errors,
)
from nemesis.history import (
    ConsumerHistory,
    FaultRecord,
    Outcome,
    Version,
    WriteRecord,
    value_for,
    version_of,
)
from nemesis.schedule import make_schedule, minority

from support.consumer import Change

OK, FAILED, AMBIGUOUS = Outcome.OK, Outcome.FAILED, Outcome.AMBIGUOUS
K = b"chaos-00001"


def writes(*outcomes: Outcome, durable: bool = True, key: bytes = K) -> list[WriteRecord]:
    return [WriteRecord(key, i + 1, o, durable) for i, o in enumerate(outcomes)]


def final(version: int | None, key: bytes = K) -> dict[bytes, bytes | None]:
    return {} if version is None else {key: value_for(key, version, 8)}


# -- values ----------------------------------------------------------------------------------


def test_the_value_names_its_key_and_version() -> None:
    assert version_of(K, value_for(K, 12, 30)) == 12
    assert version_of(b"other", value_for(K, 12)) is None
    assert version_of(K, b"garbage") is None


# -- check 1: acknowledged durable writes --------------------------------------------------


def test_the_newest_acknowledged_durable_write_at_the_end_passes() -> None:
    result = check_writes(writes(OK, OK, OK), final(3))
    assert result == WriteCheck(keys=1)


def test_a_missing_durable_write_is_lost() -> None:
    result = check_writes(writes(OK, OK), final(None))
    assert len(result.lost_durable) == 1 and "missing" in result.lost_durable[0]


def test_an_older_value_than_the_durable_write_is_lost() -> None:
    result = check_writes(writes(OK, OK, OK), final(2))
    assert len(result.lost_durable) == 1 and "final v2, v3" in result.lost_durable[0]


def test_non_durable_losses_are_information_only() -> None:
    result = check_writes(writes(OK, OK, OK, durable=False), final(1))
    assert not result.lost_durable and len(result.lost_non_durable) == 1
    missing = check_writes(writes(OK, durable=False), final(None))
    assert not missing.lost_durable and len(missing.lost_non_durable) == 1


def test_an_ambiguous_write_may_win_or_vanish() -> None:
    # Later than the durable write: took effect, or not.
    assert check_writes(writes(OK, AMBIGUOUS), final(2)) == WriteCheck(keys=1)
    assert check_writes(writes(OK, AMBIGUOUS), final(1)) == WriteCheck(keys=1)
    # Older, but ambiguous: it may have landed late (a request stuck in a frozen node).
    assert check_writes(writes(AMBIGUOUS, OK), final(1)) == WriteCheck(keys=1)
    # Never acknowledged at all: the key may be absent.
    assert check_writes(writes(AMBIGUOUS, FAILED), final(None)) == WriteCheck(keys=1)


def test_a_failed_or_unknown_value_is_a_phantom() -> None:
    failed = check_writes(writes(OK, FAILED), final(2))
    assert len(failed.phantom) == 1 and "failed" in failed.phantom[0]
    never = check_writes(writes(OK), final(7))
    assert len(never.phantom) == 1 and "never written" in never.phantom[0]
    garbage = check_writes(writes(OK), {K: b"garbage"})
    assert len(garbage.phantom) == 1


def test_keys_are_checked_independently() -> None:
    other = b"chaos-00002"
    history = writes(OK, OK) + writes(OK, key=other)
    result = check_writes(history, {**final(2), **final(None, other)})
    assert (
        result.keys == 2 and len(result.lost_durable) == 1 and repr(other) in result.lost_durable[0]
    )


# -- check 2: replicas -----------------------------------------------------------------------


def change(seqno: int, key: bytes, value: bytes, *, cas: int = 0, deleted: bool = False) -> Change:
    return Change(seqno, key, deleted, value, 0, cas or seqno * 10, 0, 0, 1)


def copy(node: str, *changes: Change, high: int | None = None, purged: int = 0) -> Copy:
    latest = {c.key: c for c in changes}
    top = max((c.seqno for c in changes), default=0)
    return Copy(node, latest, top if high is None else high, purged)


def test_equal_copies_pass() -> None:
    items = (change(1, b"a", b"1"), change(2, b"b", b"2"))
    assert check_replicas({0: (copy("n1", *items), [copy("n2", *items), copy("n3", *items)])}) == []


def test_a_divergent_replica_is_reported() -> None:
    active = copy("n1", change(1, b"a", b"1"), change(2, b"b", b"2"))
    other_value = copy("n2", change(1, b"a", b"1"), change(2, b"b", b"X"))
    other_cas = copy("n3", change(1, b"a", b"1"), change(2, b"b", b"2", cas=99))
    problems = check_replicas({5: (active, [other_value, other_cas])})
    assert len(problems) == 2 and all(p.startswith("vb 5:") for p in problems)


def test_a_replica_behind_or_ahead_is_reported() -> None:
    items = (change(1, b"a", b"1"), change(2, b"b", b"2"))
    behind = copy("n2", items[0])
    ahead = copy("n3", *items, high=3)  # a write the active does not have (nothing streamed)
    problems = check_replicas({0: (copy("n1", *items), [behind, ahead])})
    assert len(problems) == 2 and "high seqno 3 vs 2" in problems[1]


def test_a_purged_tombstone_is_not_a_divergence() -> None:
    tomb = change(3, b"c", b"", deleted=True)
    active = copy("n1", change(1, b"a", b"1"), tomb, purged=3)
    replica = copy("n2", change(1, b"a", b"1"), high=3, purged=3)  # it purged it too
    assert check_replicas({0: (active, [replica])}) == []


# -- check 3: consumer seqnos -----------------------------------------------------------------


def test_rising_seqnos_and_rollbacks_pass() -> None:
    timeline = [("item", 1), ("item", 2), ("item", 5), ("rollback", 2), ("item", 3), ("item", 4)]
    assert check_monotonic({0: timeline}) == []


def test_a_seqno_that_does_not_rise_is_reported() -> None:
    repeated = [("item", 1), ("item", 2), ("item", 2)]
    backwards = [("item", 5), ("item", 3)]
    after_rollback = [("item", 5), ("rollback", 4), ("item", 4)]
    problems = check_monotonic({0: repeated, 1: backwards, 2: after_rollback})
    assert [p.split(":")[0] for p in problems] == ["vb 0", "vb 1", "vb 2"]


def test_the_consumer_history_applies_rollbacks() -> None:
    history = ConsumerHistory()
    for seqno, value in ((1, b"1"), (2, b"2"), (3, b"3")):
        history.item(0, b"k%d" % seqno, Version(seqno, value, seqno, 1, False))
    history.item(0, b"k1", Version(4, b"4", 4, 2, False))
    history.rollback(0, 2)
    assert history.state() == {
        b"k1": Version(1, b"1", 1, 1, False),
        b"k2": Version(2, b"2", 2, 1, False),
    }
    assert history.timeline[0][-1] == ("rollback", 2) and history.rollbacks == 1
    assert check_monotonic(history.timeline) == []


# -- check 4: consumer and mirror states ------------------------------------------------------


def test_equal_states_pass() -> None:
    truth = {b"a": Version(1, b"1", 10, 1, False), b"gone": Version(2, b"", 20, 2, True)}
    assert check_state(truth, {b"a": truth[b"a"]}) == StateCheck()  # a tombstone may be absent
    assert check_state(truth, dict(truth)) == StateCheck()


def test_a_missing_key_is_reported() -> None:
    truth = {b"a": Version(1, b"1", 10, 1, False), b"b": Version(2, b"2", 20, 1, False)}
    result = check_state(truth, {b"a": truth[b"a"]})
    assert len(result.missing) == 1 and not result.stale


def test_a_stale_or_extra_key_is_reported() -> None:
    truth = {b"a": Version(5, b"new", 50, 2, False)}
    older = check_state(truth, {b"a": Version(1, b"old", 10, 1, False)})
    assert len(older.stale) == 1 and not older.missing
    other_cas = check_state(truth, {b"a": truth[b"a"]._replace(cas=51)})
    assert len(other_cas.stale) == 1
    extra = check_state(truth, {**truth, b"rolled-back": Version(6, b"x", 60, 1, False)})
    assert len(extra.stale) == 1
    resurrected = check_state(
        {b"a": Version(5, b"", 50, 2, True)}, {b"a": Version(4, b"v", 40, 1, False)}
    )
    assert len(resurrected.stale) == 1


# -- the report and the schedule ---------------------------------------------------------------


def test_the_report_fails_on_any_count_and_prints_them() -> None:
    report = ChaosReport(seed=42, schedule="one", durability="majority")
    report.writes = writes(OK, AMBIGUOUS, FAILED)
    report.faults = [FaultRecord("kill", ("n2",), 3.0, 8.5)]
    assert not report.failed
    report.write_check = check_writes(writes(OK, OK), final(1))
    report.mirror = StateCheck(stale=["b'k': ..."])
    assert report.failed
    counts = report.counts()
    assert (
        counts["lost acknowledged durable writes"] == 1 and counts["keys stale in the mirror"] == 1
    )
    text = report.render()
    assert "CHANGEFEED_CHAOS_SEED=42" in text and "1 ok, 1 failed, 1 ambiguous" in text
    assert "1 kill" in text and "FAIL      1 keys stale in the mirror" in text


def test_the_schedule_replays_from_its_seed() -> None:
    a = make_schedule(7, nodes=5, duration_s=60, targets="minority")
    assert a == make_schedule(7, nodes=5, duration_s=60, targets="minority")
    assert a != make_schedule(8, nodes=5, duration_s=60, targets="minority")
    assert all(len(s.targets) == 2 == minority(5) for s in a)
    one = make_schedule(7, nodes=3, duration_s=60, targets="one")
    assert all(len(s.targets) == 1 for s in one) and minority(3) == 1
    assert sum(s.gap_s + s.down_s for s in one) >= 60
    assert {s.kind for s in one} <= {"kill", "restart", "pause"}


def test_errors_far_from_any_fault_are_singled_out() -> None:
    fault = FaultRecord("pause", ("n1",), 10.0, 15.0)
    during = WriteRecord(K, 1, FAILED, True, "DurabilityImpossibleError", 12.0, 12.5)
    settling = WriteRecord(K, 2, AMBIGUOUS, True, "SyncWriteAmbiguousError", 20.0, 30.0)
    calm = WriteRecord(K, 3, FAILED, True, "DurabilityImpossibleError", 40.0, 40.1)
    fine = WriteRecord(K, 4, OK, True, "", 50.0, 50.1)
    assert unexplained_errors([during, settling, calm, fine], [fault]) == [calm]
