"""memsnap.mounts: which mounts of a job's namespace its image keeps (pure logic over mountinfo text)."""

from __future__ import annotations

from memsnap import mounts

# Ours (the daemon's namespace): / on 8:1, /dev, /dev/shm, /run (tmpfs), /run/netns/x (nsfs), /data, /proc.
OURS = """\
20 1 8:1 / / rw - ext4 /dev/vda rw
21 20 0:5 / /dev rw - devtmpfs udev rw
22 21 0:23 / /dev/shm rw - tmpfs tmpfs rw
23 20 0:24 / /run rw - tmpfs tmpfs rw
24 23 0:4 net:[4026532000] /run/netns/x rw - nsfs nsfs rw
25 20 8:2 / /data rw - ext4 /dev/vdb rw
26 20 0:22 / /proc rw - proc proc rw
"""

# The job's: copies of ours, its own /proc, its private /tmp with the job log bound in it, and a tmpfs the host
# unmounted since (0:99: not ours any more).
JOBS = """\
120 101 8:1 / / rw - ext4 /dev/vda rw
121 120 0:5 / /dev rw - devtmpfs udev rw
122 121 0:23 / /dev/shm rw - tmpfs tmpfs rw
123 120 0:24 / /run rw - tmpfs tmpfs rw
124 123 0:4 net:[4026532000] /run/netns/x rw - nsfs nsfs rw
125 120 8:2 / /data rw - ext4 /dev/vdb rw
126 120 0:70 / /proc rw - proc proc rw
127 120 0:71 / /tmp rw - tmpfs memsnap-tmp rw
128 127 8:1 /var/lib/memsnap/state/jobs/job-1.log /tmp/.memsnap/log rw - ext4 /dev/vda rw
129 120 0:99 / /old-tier rw - tmpfs tmpfs rw
130 125 8:2 /scratch /data/scratch rw - ext4 /dev/vdb rw
"""


def _left_out(used: set[int]) -> list[str]:
    return mounts.left_out(mounts.parse(JOBS), mounts.parse(OURS), used)


def test_unused_host_mounts_and_a_stale_tmpfs_are_left_out_the_system_and_private_tmp_kept() -> None:
    assert sorted(_left_out(set())) == ["/data", "/data/scratch", "/old-tier", "/run/netns/x"]


def test_a_mount_the_job_uses_is_kept_with_the_mounts_above_it() -> None:
    assert sorted(_left_out({130})) == ["/old-tier", "/run/netns/x"]  # /data/scratch used: /data stays too


def test_the_job_log_bind_mount_is_found_and_paths_with_spaces_are_unescaped() -> None:
    ms = mounts.parse(JOBS + "131 120 8:1 / /a\\040b rw - ext4 /dev/vda rw\n")
    assert [m.point for m in ms if m.point == mounts.JOB_LOG] == [mounts.JOB_LOG]
    assert ms[-1].point == "/a b"


def test_mountinfo_lines_that_do_not_parse_are_skipped() -> None:
    assert mounts.parse("garbage\n1 2 3\n" + OURS.splitlines()[0]) == mounts.parse(OURS.splitlines()[0])
