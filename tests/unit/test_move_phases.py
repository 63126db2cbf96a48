"""A move's phase list on the wire: never a negative duration (the field is unsigned)."""

from memsnap.migrate import _Phases as Phases


def test_a_phase_ended_before_the_last_mark_reports_zero_not_an_error():
    ph = Phases()
    t = ph.mark("resumed")
    ph.mark("pages", now=t - 0.003)  # the last page arrived 3 ms before the resume was heard
    assert [(p.name, p.ms) for p in ph.pb()][1] == ("pages", 0)
