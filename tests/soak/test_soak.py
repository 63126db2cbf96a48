"""The soak in CI: for each real program, a seeded sequence of operations on two nodes, with its data and both
nodes checked after every step (tests/soak/sequence.py). The long run is scripts/soak.py."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.helpers import need, restorable_ids
from tests.soak import cluster as clusters
from tests.soak.cluster import Cluster
from tests.soak.programs import KINDS, make
from tests.soak.sequence import OPS, Runner

STEPS = 12
NEEDS = {"redis": ("redis-server", "redis-cli"), "memcached": ("memcached",), "nginx": ("nginx", "wrk", "ab"),
         "jvm": ("java", "javac"), "sqlite": (), "torch": ()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = clusters.build(tmp_path_factory.mktemp("soak"))
    yield c
    c.close()


def plan(kind: str, seed: int, steps: int = STEPS) -> list[str]:
    """The operations of one program's sequence: every kind of operation it allows once (in a seeded order),
    then seeded draws."""
    rng = random.Random(f"{kind}-{seed}")
    ops = [o for o in OPS if o != "park-resume" or KINDS[kind].parkable]
    first = rng.sample(ops, len(ops))
    return (first + [rng.choice(ops) for _ in range(steps)])[:max(steps, len(first))]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_real_program_survives_a_seeded_sequence_of_operations(kind, cluster, jobs_to_kill):
    need(*NEEDS[kind])
    index = sorted(KINDS).index(kind)
    p = make(kind, cluster, index)
    runner = Runner(cluster, [p], random.Random(index))
    try:
        p.start(cluster.a)
        jobs_to_kill.append(p.pid)
        for op in plan(kind, 1):
            runner.step(p, op)
            jobs_to_kill.append(p.pid)
        p.finish()
    finally:
        p.stop()
        _tidy(cluster)
    assert all(r.ok for r in runner.results)


def _tidy(cluster: Cluster) -> None:
    """Deletes what a failed sequence left restorable, so that the next program's checks judge its own steps
    (the failure itself is already recorded)."""
    for d in cluster.nodes:
        for ck in restorable_ids(d):
            d.ctl("delete", ck)
