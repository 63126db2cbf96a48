"""memsnap.progress: an operation is found only by the uid that started it (root sees all), and two users
choosing the same op id never collide."""

from memsnap import progress


def test_same_op_id_of_two_owners_are_two_operations_each_seen_by_its_owner_only() -> None:
    with progress.begin("op1", "restore", 1000) as a, progress.begin("op1", "migrate", 65534) as b:
        assert a is not None and b is not None and a is not b
        assert progress.get("op1", 1000, False) is a
        assert progress.get("op1", 65534, False) is b
        assert progress.get("op1", 4242, False) is None
        assert progress.get("op1", 0, True) in (a, b)
    assert progress.get("op1", 1000, False) is None


def test_an_owner_cannot_start_the_same_op_id_twice() -> None:
    with progress.begin("op2", "restore", 1000) as a, progress.begin("op2", "restore", 1000) as again:
        assert a is not None and again is None
        assert progress.get("op2", 1000, False) is a
