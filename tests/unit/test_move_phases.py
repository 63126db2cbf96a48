"""A move's phase list: never a negative duration (the wire field is unsigned)."""

from memsnap.move.plan import Phases


def test_a_phase_ended_before_the_last_mark_reports_zero_not_a_negative_duration():
    ph = Phases()
    t = ph.mark("resumed")
    ph.mark("pages", now=t - 0.003)  # the last page arrived 3 ms before the resume was heard
    assert ph.items[1] == ("pages", 0.0)
