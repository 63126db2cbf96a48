"""tier.mount's pure parts: the tmpfs options memsnapd mounts with, how an existing mount differs from them,
/proc/self/mountinfo parsing, and the [tier] keys' validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from memsnap.config import ConfigError, load_config
from memsnap.metrics import Metrics
from memsnap.tier import (
    MemoryTier,
    MountSpec,
    host_takes_back_free_memory,
    mount_point_entry,
    parse_mountinfo,
    resolve_huge_pages,
)

MOUNTINFO = """\
27 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw,errors=remount-ro
30 27 0:26 / /dev/shm rw,nosuid,nodev shared:5 - tmpfs tmpfs rw,inode64
43 30 0:39 / /dev/shm/memsnap rw,nosuid,nodev,noexec,relatime shared:6 master:2 - tmpfs memsnap \
rw,size=1048576k,mode=700,huge=within_size,mpol=bind:0
44 27 0:40 / /var/tmp/a\\040b rw,relatime - tmpfs tmpfs rw
bad line
"""


def test_options_are_root_only_with_size_huge_pages_and_the_numa_policy() -> None:
    assert MountSpec().options() == "mode=0700,uid=0,gid=0,huge=within_size"
    assert MountSpec(1 << 30, "never", 0).options() == "mode=0700,uid=0,gid=0,size=1073741824,huge=never,mpol=bind:0"


def test_mountinfo_is_parsed_past_optional_fields_and_with_escapes_decoded() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert sorted(mounts) == [27, 30, 43, 44]
    m = mounts[43]
    assert (m.mount_point, m.fstype, m.source) == ("/dev/shm/memsnap", "tmpfs", "memsnap")
    assert m.options == {"rw": "", "size": "1048576k", "mode": "700", "huge": "within_size", "mpol": "bind:0"}
    assert m.ours and not mounts[30].ours
    assert mounts[44].mount_point == "/var/tmp/a b"


def test_a_dir_is_a_mount_point_only_when_its_mount_is_mounted_right_there() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert mount_point_entry(mounts, 43, "/dev/shm/memsnap") is mounts[43]
    assert mount_point_entry(mounts, 30, "/dev/shm/memsnap") is None  # a plain directory on /dev/shm's tmpfs
    assert mount_point_entry(mounts, 99, "/dev/shm/memsnap") is None


def test_an_existing_mount_matches_the_spec_in_the_kernels_spelling_or_says_what_differs() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert MountSpec(1 << 30, "within_size", 0).differences(mounts[43]) == []
    assert MountSpec(0, "always", -1).differences(mounts[43]) == ["huge=within_size, config: always",
                                                                  "mpol=bind:0, config: none"]
    assert MountSpec(2 << 30).differences(mounts[43]) == ["mpol=bind:0, config: none",
                                                          "size=1048576k, config: 2097152k"]
    assert MountSpec().differences(mounts[30]) == ["huge=never, config: within_size", "mode=1777, config: 700"]
    assert MountSpec().differences(mounts[27]) == ["a ext4 filesystem, not a tmpfs"]


def test_tier_mount_is_off_by_default_with_huge_pages_auto() -> None:
    tier = load_config("/dev/null").tier
    assert (tier.mount, tier.huge_pages) == (False, "auto")
    assert load_config("/dev/null", {"tier.mount": "true", "tier.huge_pages": "Never"}).tier.huge_pages == "never"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"tier.huge_pages": "2M"}, 'override: tier.huge_pages: expected one of "auto", "within_size", "never", '
                                '"always", "advise", got "2M"'),
    ({"tier.mount": "maybe"}, "override: tier.mount: expected"),
    ({"tier.mount": "true", "tier.kind": "devdax"}, "override: tier.mount: memsnapd mounts only a tmpfs"),
])
def test_bad_tier_mount_settings_are_one_line_config_errors(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("/dev/null", overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_tier_that_is_a_plain_directory_reports_its_filesystem_and_not_mounted_by_memsnapd(tmp_path) -> None:
    tier = MemoryTier(tmp_path / "tier")
    info = tier.info()
    assert info["kind"] == "tmpfs" and info["mounted_by_memsnapd"] is False and info["fstype"] not in ("", "unknown")
    assert not tier.mount_point and tier.describe().startswith(f"a directory on {info['fstype']}")


def test_the_tier_info_metric_carries_the_labels() -> None:
    m = Metrics()
    m.set_tier_info("numa", "tmpfs", True, "within_size")
    assert ('memsnap_tier_info{fstype="tmpfs",huge_pages="within_size",kind="numa",mounted_by_memsnapd="true"} 1.0'
            in m.render().decode())


@pytest.mark.parametrize("features,reclaims", [
    ("01100101000000000000000000000000100000000000000000000000000000000000000000000000000000000000000000000000", True),
    ("01100001000000000000000000000000100000000000000000000000000000000000000000000000000000000000000000000000", False),
    ("0110", False), ("", False)])
def test_a_balloon_with_free_page_reporting_means_freed_memory_is_the_hosts_and_auto_takes_no_huge_pages(
        tmp_path: Path, features: str, reclaims: bool) -> None:
    (tmp_path / "virtio0").mkdir()  # (bit 5 of the device's features: VIRTIO_BALLOON_F_REPORTING)
    (tmp_path / "virtio0" / "features").write_text(features + "\n")
    assert host_takes_back_free_memory(tmp_path) is reclaims
    assert host_takes_back_free_memory(tmp_path / "no-balloon-driver") is False
    assert resolve_huge_pages("auto", tmp_path) == ("never" if reclaims else "within_size")
    assert resolve_huge_pages("within_size", tmp_path) == "within_size"  # (what the config names is what it gets)
    assert resolve_huge_pages("auto", tmp_path / "no-balloon-driver") == "within_size"
