"""The guard's park stops a job's tree parents first (memsnap.guard.park.stop_top_down): a child that stops sends
its parent SIGCHLD, and a parent thread taking it while the cgroup is at its limit cannot get a signal frame's
stack page charged; the kernel then kills the job with SIGSEGV (SI_KERNEL), as it did to a PyTorch DataLoader
job in the soak. Pure logic: a fake kill and a fake wait."""

from __future__ import annotations

from memsnap.guard.park import stop_top_down

#        1
#      /   \
#     2     3
#    / \     \
#   4   5     6
TREE = [(1, 99), (2, 1), (3, 1), (4, 2), (5, 2), (6, 3)]


def test_each_generation_is_stopped_whole_before_its_children_are_signalled() -> None:
    events: list[tuple[str, object]] = []
    ok = stop_top_down(1, TREE, lambda pid: events.append(("stop", pid)),
                       lambda pids, t: events.append(("wait", sorted(pids))) or True,
                       lambda: events.append(("headroom", None)), 10.0)
    assert ok
    assert events == [("stop", 1), ("headroom", None), ("wait", [1]),
                      ("stop", 2), ("stop", 3), ("wait", [2, 3]),
                      ("stop", 4), ("stop", 5), ("stop", 6), ("wait", [4, 5, 6])]


def test_a_generation_that_does_not_stop_still_lets_the_rest_be_stopped_and_says_so() -> None:
    stopped: list[int] = []
    ok = stop_top_down(1, TREE, stopped.append, lambda pids, t: 2 not in pids, lambda: None, 10.0)
    assert not ok and sorted(stopped) == [1, 2, 3, 4, 5, 6]


def test_a_tree_of_one_and_a_cycle_in_bad_ppids_end() -> None:
    stopped: list[int] = []
    assert stop_top_down(7, [(7, 1)], stopped.append, lambda pids, t: True, lambda: None, 1.0)
    assert stopped == [7]
    stopped.clear()
    assert stop_top_down(1, [(1, 2), (2, 1)], stopped.append, lambda pids, t: True, lambda: None, 1.0)
    assert stopped == [1, 2]
