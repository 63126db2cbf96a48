"""The systemd unit passes `systemd-analyze verify` and keeps the settings jobs rely on."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "memsnapd.service"


def service_settings() -> dict[str, list[str]]:
    """[Service] keys of the unit, each with all its values in order."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "Service":
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is missing: run the CI install step (apt-get install -y systemd)")
    binary = shutil.which("memsnapd") or sys.executable
    assert " " not in binary, binary
    text = re.sub(r"(?m)^ExecStart=\S+", f"ExecStart={binary}", UNIT.read_text())
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    proc = subprocess.run(
        [analyze, "verify", "--man=no", str(copy)], check=False, capture_output=True, text=True, timeout=120
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    complaints = [line for line in output.splitlines() if UNIT.name in line or str(tmp_path) in line]
    assert not complaints, output


def test_unit_keeps_jobs_alive_and_notifies() -> None:
    service = service_settings()
    assert service["Type"] == ["notify"]
    assert service["NotifyAccess"] == ["main"]
    assert service["KillMode"] == ["process"]
    assert service["WatchdogSec"] == ["30"]
    assert service["Restart"] == ["on-failure"]
    assert service["ExecStart"] == ["/usr/local/bin/memsnapd --config /etc/memsnap/memsnap.toml"]
    assert service["RemoveIPC"] == ["no"]
    assert service["RuntimeDirectory"] == ["memsnap"]
    assert service["StateDirectory"] == ["memsnap"]
    assert service["LimitNOFILE"] == ["1048576"]


def test_unit_grants_what_criu_needs_and_no_sandboxing() -> None:
    service = service_settings()
    caps = " ".join(service["CapabilityBoundingSet"]).split()
    for cap in (
        "CAP_CHECKPOINT_RESTORE",
        "CAP_SYS_ADMIN",
        "CAP_SYS_PTRACE",
        "CAP_SYS_RESOURCE",
        "CAP_NET_ADMIN",
        "CAP_DAC_OVERRIDE",
        "CAP_KILL",
        "CAP_SETUID",
        "CAP_SETGID",
        "CAP_FOWNER",
        "CAP_SYS_CHROOT",
        "CAP_NET_RAW",
        "CAP_SETPCAP",
    ):
        assert cap in caps, cap
    forbidden = {
        "ProtectSystem",
        "PrivateTmp",
        "NoNewPrivileges",
        "SystemCallFilter",
        "MemoryDenyWriteExecute",
        "RestrictNamespaces",
        "PrivateDevices",
        "PrivateNetwork",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectHome",
        "PrivateMounts",  # (and MountFlags: tier.mount's tmpfs must outlive the unit's main process)
        "MountFlags",
    }
    assert not forbidden & service.keys()
    assert not any("/dev/shm" in value for value in service.get("RuntimeDirectory", []))
