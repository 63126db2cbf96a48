"""Network storage for the benchmark: an sshd inside a network namespace, reached over a veth pair whose
two ends are rate-limited with tc tbf, mounted here with sshfs and used as memsnap's POSIX store.

Why sshfs and not moto's S3 server: moto (in-memory, pure Python) sustained only ~620 Mbit/s for a
multipart PUT on this VM with no rate limit at all, so a 1 Gbit/s link would have measured moto, not the
link. sshfs (OpenSSH, aes128-gcm with AES-NI, sftp writes into a disk directory inside the namespace) moves
~1.6 Gbit/s unthrottled, so with tbf at 1 Gbit/s the link is the bottleneck. `check()` re-measures both.

Everything created here (namespace, veth, sshd, mount, keys) is removed by teardown(), which is also safe
to call after a crash of a previous run (it only touches names with this module's prefix).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NS = "msbench"
VETH_HOST = "msbench-h"
VETH_NS = "msbench-n"
HOST_IP = "10.213.77.1"
NS_IP = "10.213.77.2"
PORT = 2222
CIPHER = "aes128-gcm@openssh.com"


def sh(*cmd: str, check: bool = True, ns: bool = False) -> subprocess.CompletedProcess[str]:
    full = ["ip", "netns", "exec", NS, *cmd] if ns else list(cmd)
    r = subprocess.run(full, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


@dataclass
class NetStore:
    """The rate-limited sshfs store. `mount` is the local path; files land in `backing` (inside the ns)."""

    base: Path
    rate_mbit: int = 1000
    cipher: str = CIPHER
    sshfs_opts: tuple[str, ...] = ()  # extra sshfs -o options (e.g. "max_conns=4")
    mount: Path = field(init=False)
    backing: Path = field(init=False)
    sshd_pid: int = 0

    def __post_init__(self) -> None:
        self.mount = self.base / "mnt"
        self.backing = self.base / "backing"
        self.keys = self.base / "ssh"

    # -- life cycle ---------------------------------------------------------------------------
    def setup(self) -> NetStore:
        self.teardown()
        for d in (self.mount, self.backing, self.keys):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        Path("/run/sshd").mkdir(exist_ok=True, mode=0o755)  # sshd's privilege separation dir
        sh("ip", "netns", "add", NS)
        sh("ip", "link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS)
        sh("ip", "link", "set", VETH_NS, "netns", NS)
        sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", VETH_HOST)
        sh("ip", "link", "set", VETH_HOST, "up")
        sh("ip", "addr", "add", f"{NS_IP}/30", "dev", VETH_NS, ns=True)
        sh("ip", "link", "set", VETH_NS, "up", ns=True)
        sh("ip", "link", "set", "lo", "up", ns=True)
        self.set_rate(self.rate_mbit)
        for name in ("hostkey", "clientkey"):
            if not (self.keys / name).exists():
                sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.keys / name))
        shutil.copy(self.keys / "clientkey.pub", self.keys / "authorized_keys")
        os.chmod(self.keys / "authorized_keys", 0o600)
        (self.keys / "sshd_config").write_text(
            f"ListenAddress {NS_IP}:{PORT}\nHostKey {self.keys}/hostkey\n"
            f"AuthorizedKeysFile {self.keys}/authorized_keys\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            f"Subsystem sftp internal-sftp\nPidFile {self.keys}/sshd.pid\nCiphers {self.cipher}\n"
        )
        sh("/usr/sbin/sshd", "-f", str(self.keys / "sshd_config"), "-E", str(self.keys / "sshd.log"), ns=True)
        for _ in range(100):
            if (self.keys / "sshd.pid").exists():
                break
            time.sleep(0.05)
        self.sshd_pid = int((self.keys / "sshd.pid").read_text())
        opts = (
            f"IdentityFile={self.keys}/clientkey,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,"
            f"Port={PORT},Ciphers={self.cipher},Compression=no,LogLevel=ERROR"
        )
        opts = ",".join((opts, *self.sshfs_opts))
        sh("sshfs", "-o", opts, f"root@{NS_IP}:{self.backing}", str(self.mount))
        return self

    def set_rate(self, mbit: int | None) -> None:
        """Shapes both directions (host->ns = uploads, ns->host = downloads); None removes the limit."""
        self.rate_mbit = mbit or 0
        for dev, ns in ((VETH_HOST, False), (VETH_NS, True)):
            sh("tc", "qdisc", "del", "dev", dev, "root", check=False, ns=ns)
            if mbit:
                burst = max(64 << 10, mbit * 1_000_000 // 8 // 250)  # 4 ms worth of bytes
                sh(
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    f"{mbit}mbit",
                    "burst",
                    str(burst),
                    "latency",
                    "20ms",
                    ns=ns,
                )

    def qdisc(self) -> str:
        return sh("tc", "qdisc", "show", "dev", VETH_HOST).stdout.strip()

    def teardown(self) -> None:
        mnt = self.base / "mnt"
        if mnt.is_dir() and os.path.ismount(mnt):
            if sh("fusermount3", "-u", str(mnt), check=False).returncode != 0:
                sh("umount", "-l", str(mnt), check=False)
        pidfile = self.base / "ssh" / "sshd.pid"
        if pidfile.exists():
            try:
                pid = int(pidfile.read_text())
                # Only our sshd: the one whose command line names our config file.
                if str(self.base) in Path(f"/proc/{pid}/cmdline").read_text():
                    os.kill(pid, 15)
            except (OSError, ValueError):
                pass
            pidfile.unlink(missing_ok=True)
        if NS in sh("ip", "netns", "list", check=False).stdout.split():
            sh("ip", "netns", "del", NS, check=False)
        sh("ip", "link", "del", VETH_HOST, check=False)
        if not os.path.ismount(mnt):  # the store's files (GBs of images) live on the VM's disk: drop them
            shutil.rmtree(self.base / "backing", ignore_errors=True)

    # -- measurement ------------------------------------------------------------------------------
    def check(self, mib: int = 256) -> dict[str, float]:
        """Sequential write (fsynced) and read of mib MiB of random data through the mount, in MB/s."""
        data = os.urandom(4 << 20)
        path = self.mount / "linkcheck.bin"
        t0 = time.monotonic()
        with open(path, "wb") as f:
            for i in range(mib // 4):
                f.write(data[i % 7 :] + data[: i % 7])  # not identical chunks
            f.flush()
            os.fsync(f.fileno())
        w = mib * (1 << 20) / (time.monotonic() - t0) / 1e6
        t0 = time.monotonic()
        with open(path, "rb") as f:
            while f.read(4 << 20):
                pass
        r = mib * (1 << 20) / (time.monotonic() - t0) / 1e6
        path.unlink()
        return {"write_MBps": round(w, 1), "read_MBps": round(r, 1), "mib": mib}
