"""The node pressure policy (memsnap.guard.policy) with an injected clock: sustain, order, cooldown,
hysteresis, fit."""

from __future__ import annotations

from memsnap.guard.policy import CRITICAL, Candidate, NodePolicy, Parked, Thresholds
from memsnap.guard.psi import NodeSample, parse_meminfo, parse_psi

GiB = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def policy(**kw: float) -> tuple[NodePolicy, Clock]:
    clock = Clock()
    base: dict[str, float] = {"some_avg10": 20.0, "sustain_s": 10, "cooldown_s": 5, "resume_below_some": 5.0,
                              "resume_sustain_s": 30, "resume_margin": GiB}
    th = Thresholds(**{**base, **kw})  # type: ignore[arg-type]
    return NodePolicy(th, clock), clock


HIGH = NodeSample(some_avg10=50.0, mem_available=8 * GiB, mem_total=24 * GiB)
MID = NodeSample(some_avg10=10.0, mem_available=8 * GiB, mem_total=24 * GiB)  # between the two thresholds
LOW = NodeSample(some_avg10=1.0, mem_available=8 * GiB, mem_total=24 * GiB)
JOBS = [Candidate("crit", CRITICAL), Candidate("mid", 5), Candidate("low", -5), Candidate("zero", 0)]


def test_pressure_must_last_sustain_s_before_a_park() -> None:
    p, clock = policy()
    assert p.decide(HIGH, JOBS, []) is None
    clock.t += 9.9
    assert p.decide(HIGH, JOBS, []) is None
    clock.t += 0.1
    d = p.decide(HIGH, JOBS, [])
    assert d is not None and d.action == "park"


def test_a_dip_restarts_the_sustain_window() -> None:
    p, clock = policy()
    p.decide(HIGH, JOBS, [])
    clock.t += 8
    p.decide(LOW, JOBS, [])
    clock.t += 1
    p.decide(HIGH, JOBS, [])
    clock.t += 9
    assert p.decide(HIGH, JOBS, []) is None


def test_parks_lowest_priority_first_one_per_cooldown_and_never_critical() -> None:
    p, clock = policy()
    running = list(JOBS)
    order = []
    p.decide(HIGH, running, [])
    for _ in range(20):
        clock.t += 1
        d = p.decide(HIGH, running, [])
        if d is not None:
            assert d.action == "park"
            order.append((clock.t, d.job_id))
            running = [c for c in running if c.job_id != d.job_id]
    assert [j for _, j in order] == ["low", "zero", "mid"]
    assert all(b - a >= 5 for (a, _), (b, _) in zip(order, order[1:], strict=False))
    assert [c.job_id for c in running] == ["crit"]


def test_equal_priority_parks_the_youngest_first() -> None:
    p, clock = policy(sustain_s=0)
    d = p.decide(HIGH, [Candidate("old", 0, started_ms=1), Candidate("new", 0, started_ms=2)], [])
    assert d is not None and d.job_id == "new"


def test_mem_available_threshold_counts_the_tiers_inflight_bytes() -> None:
    p, clock = policy(some_avg10=0, mem_available_min=2 * GiB, sustain_s=0)
    s = NodeSample(mem_available=3 * GiB)
    assert p.decide(s, JOBS, []) is None
    d = p.decide(s, JOBS, [], tier_ram_bytes=2 * GiB)
    assert d is not None and d.action == "park" and "MemAvailable" in d.reason


def test_no_resume_until_calm_for_resume_sustain_s_and_not_between_thresholds() -> None:
    p, clock = policy()
    parked = [Parked("low", -5, GiB)]
    for _ in range(40):  # between the thresholds: neither park nor resume (hysteresis)
        clock.t += 1
        assert p.decide(MID, [], parked) is None
    assert p.decide(LOW, [], parked) is None
    clock.t += 29
    assert p.decide(LOW, [], parked) is None
    clock.t += 1
    d = p.decide(LOW, [], parked)
    assert d is not None and (d.action, d.job_id) == ("resume", "low")


def test_resumes_highest_priority_first_one_per_calm_period() -> None:
    p, clock = policy(resume_sustain_s=30)
    parked = [Parked("low", -5, GiB), Parked("crit", CRITICAL, GiB), Parked("mid", 5, GiB)]
    got = []
    for _ in range(200):
        clock.t += 1
        d = p.decide(LOW, [], parked)
        if d is not None:
            got.append((clock.t, d.job_id))
            parked = [x for x in parked if x.job_id != d.job_id]
    assert [j for _, j in got] == ["crit", "mid", "low"]
    assert all(b - a >= 30 for (a, _), (b, _) in zip(got, got[1:], strict=False))


def test_a_higher_priority_image_that_does_not_fit_blocks_lower_ones() -> None:
    p, clock = policy(resume_sustain_s=1)
    parked = [Parked("big", 9, 20 * GiB), Parked("small", 1, GiB)]
    for _ in range(10):
        clock.t += 1
        assert p.decide(LOW, [], parked) is None  # 20 GiB + 1 GiB margin > 8 GiB available


def test_no_flapping_park_then_resume_needs_a_full_calm_period_after_the_park() -> None:
    p, clock = policy(sustain_s=1, resume_sustain_s=30)
    p.decide(HIGH, [Candidate("a", 0)], [])
    clock.t += 1
    d = p.decide(HIGH, [Candidate("a", 0)], [])
    assert d is not None and d.action == "park"
    parked = [Parked("a", 0, GiB)]
    clock.t += 1
    assert p.decide(LOW, [], parked) is None
    clock.t += 29
    assert p.decide(LOW, [], parked) is None
    clock.t += 1
    d = p.decide(LOW, [], parked)
    assert d is not None and d.action == "resume"


def test_no_threshold_means_no_node_policy() -> None:
    p = NodePolicy(Thresholds(), Clock())
    assert p.decide(NodeSample(some_avg10=100, full_avg10=100), JOBS, []) is None


def test_psi_and_meminfo_parsing() -> None:
    some, full = parse_psi("some avg10=12.50 avg60=1.00 avg300=0.00 total=5\n"
                           "full avg10=3.25 avg60=0.00 avg300=0.00 total=2\n")
    assert (some, full) == (12.5, 3.25)
    avail, total = parse_meminfo("MemTotal:       24684092 kB\nMemFree: 1 kB\nMemAvailable:   22981992 kB\n")
    assert (avail, total) == (22981992 * 1024, 24684092 * 1024)
