"""``batch_size.seqnos_between``: the seqnos a micro-batch's offsets span, against a model, and
fuzzed with offsets that are not the source's (another source's, or broken JSON): those give
None (the writer then takes the tasks' path), never an error. The same count read from a
running query's offset log is checked against Spark's progress in ``test_adaptive_mirror.py``."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from changefeed.spark.batch_size import seqnos_between

VBUCKETS = st.integers(min_value=0, max_value=15)
OFFSET = st.fixed_dictionaries(
    {"vb_uuid": st.integers(min_value=0, max_value=3), "seqno": st.integers(0, 10_000)}
)
OFFSETS = st.dictionaries(VBUCKETS, OFFSET, max_size=8)


def as_json(offsets: dict[int, dict[str, int]]) -> str:
    return json.dumps({str(vb): o for vb, o in offsets.items()})


def model(starts: dict[int, dict[str, int]] | None, ends: dict[int, dict[str, int]]) -> int:
    total = 0
    for vb, end in ends.items():
        start = (starts or {}).get(vb, {"vb_uuid": 0, "seqno": 0})
        total += max(0, end["seqno"] - start["seqno"])
        branch = start["vb_uuid"] not in (0, end["vb_uuid"])
        total += 1 if branch else 0
    return total


@given(st.one_of(st.none(), OFFSETS), OFFSETS)
def test_span_matches_the_model(
    starts: dict[int, dict[str, int]] | None, ends: dict[int, dict[str, int]]
) -> None:
    start_texts: list[str | None] | None = None if starts is None else [as_json(starts)]
    assert seqnos_between(start_texts, [as_json(ends)]) == model(starts, ends)


@given(OFFSETS, OFFSETS, OFFSETS, OFFSETS)
def test_several_sources_add_up(
    s1: dict[int, dict[str, int]], e1: dict[int, dict[str, int]],
    s2: dict[int, dict[str, int]], e2: dict[int, dict[str, int]],
) -> None:  # fmt: skip
    got = seqnos_between([as_json(s1), as_json(s2)], [as_json(e1), as_json(e2)])
    assert got == model(s1, e1) + model(s2, e2)


@given(st.one_of(st.text(max_size=40), st.sampled_from(["5", "[1]", '{"x": 1}', "null", "{}"])))
def test_offsets_of_another_source_are_unknown(text: str) -> None:
    got = seqnos_between(None, [text])
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and all(k.isdigit() for k in parsed):
        assert got is None or got >= 0, text  # perhaps ours: a count, or None if malformed
    else:
        assert got is None, text
    if parsed == {}:
        assert got == 0  # a source with no vbuckets


def test_a_rollback_counts_one_row_and_no_negative_span() -> None:
    starts = [as_json({3: {"vb_uuid": 7, "seqno": 500}})]
    assert seqnos_between(starts, [as_json({3: {"vb_uuid": 9, "seqno": 200}})]) == 1
    assert seqnos_between(starts, [as_json({3: {"vb_uuid": 7, "seqno": 520}})]) == 20
    assert seqnos_between(starts, [None]) is None  # a source without an end offset
