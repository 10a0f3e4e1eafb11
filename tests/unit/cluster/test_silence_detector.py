"""rules.SilenceDetector: a node is silent once nothing it was sent in `silence_s` was answered
(two probes at least, the later sent after the first), and answers again at its first answer;
against a plain model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.cluster.rules import SilenceDetector


def test_two_unanswered_probes_spanning_the_silence_make_a_node_silent() -> None:
    detector = SilenceDetector(silence_s=0.8)
    assert not detector.observe("n1", answered=False, sent=10.0, now=10.4)
    assert not detector.observe("n1", answered=False, sent=10.6, now=10.7)  # 0.7 s: not yet
    assert detector.observe("n1", answered=False, sent=11.2, now=11.6)
    assert not detector.observe("n2", answered=False, sent=11.2, now=11.6)  # per node
    assert not detector.observe("n1", answered=True, sent=11.8, now=11.801)
    assert not detector.observe("n1", answered=False, sent=12.0, now=12.9)  # starts again


def test_one_slow_probe_is_not_silence() -> None:
    """A single probe that took longer than the silence (a stalled orchestrator) proves
    nothing about the node: a second one sent later must go unanswered too."""
    detector = SilenceDetector(silence_s=0.8)
    assert not detector.observe("n1", answered=False, sent=0.0, now=5.0)
    assert detector.observe("n1", answered=False, sent=5.2, now=5.6)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
        max_size=40,
    )
)
def test_silent_exactly_when_the_model_says(probes: list[tuple[bool, float, float]]) -> None:
    detector = SilenceDetector(silence_s=0.8)
    clock = 0.0
    unanswered: list[float] = []  # send times since the last answer
    for answered, gap, took in probes:
        sent = clock + gap
        now = sent + took
        clock = now
        result = detector.observe("n", answered=answered, sent=sent, now=now)
        if answered:
            unanswered = []
            assert not result
            continue
        unanswered.append(sent)
        # silent: unanswered for the whole silence, and a probe sent after the first one
        expected = sent > unanswered[0] and now - unanswered[0] >= 0.8
        assert result == expected, (unanswered, now)


def test_a_takeover_keeps_the_silence_another_detector_saw() -> None:
    standby = SilenceDetector(silence_s=0.6)
    assert not standby.observe("n1", answered=False, sent=1.0, now=1.3)
    assert standby.observe("n1", answered=False, sent=1.4, now=1.7)
    since = standby.silent_since("n1")
    assert since == 1.0
    leader = SilenceDetector(silence_s=0.6)
    leader.assume_silent("n1", since)
    assert leader.observe("n1", answered=False, sent=1.9, now=2.2)  # silent still: no new wait
    assert not leader.observe("n1", answered=True, sent=2.3, now=2.31)
    assert leader.silent_since("n1") is None
