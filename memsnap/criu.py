"""The one place that runs CRIU: a typed adapter over its RPC mode (`criu swrk`), as runc does it."""

from __future__ import annotations

import logging
import os
import select
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from memsnap import criu_in_ns, criuwatch, knobs, mounts, proc
from memsnap.criulog import HARMLESS as _HARMLESS
from memsnap.criulog import error_lines, hint_for
from memsnap.criurpc import criu_rpc_pb2 as rpc
from memsnap.criurpc import criu_stats_pb2 as stats_pb

log = logging.getLogger(__name__)

# A notify callback gets the script name and pid; returning False aborts the operation.
NotifyCallback = Callable[[str, int], bool]

_MAX_MSG = 1 << 20


class CriuError(Exception):
    """CRIU refused or failed; `reason` is CRIU's own words, `log_path` has the details."""

    def __init__(self, op: str, reason: str, log_path: str = "", errno: int = 0) -> None:
        self.op, self.reason, self.log_path, self.errno = op, reason, log_path, errno
        where = f" (log: {log_path})" if log_path else ""
        super().__init__(f"criu {op} failed: {reason}{where}")


class CriuNotFound(CriuError):
    """No usable criu binary."""


class CriuStalled(CriuError):
    """CRIU made no progress for its deadline (memsnap.criuwatch): it was killed, its tasks first."""


@dataclass
class DumpStats:
    """What a dump cost: CRIU's own timers plus our wall clock."""

    wall_ms: float
    freezing_ms: float = 0.0
    frozen_ms: float = 0.0
    memdump_ms: float = 0.0
    memwrite_ms: float = 0.0
    pages_written: int = 0
    pages_lazy: int = 0
    bytes_written: int = 0


@dataclass(kw_only=True)
class CriuOptions:
    """What a dump and a restore share."""

    tcp_established: bool = False
    shell_job: bool = False
    ext_unix_sk: bool = True
    file_locks: bool = True
    lazy_pages: bool = False
    network_lock_nft: bool = True
    # The caller locks the connections itself (memsnap.net, for moves between nodes).
    network_lock_skip: bool = False
    external: list[str] = field(default_factory=list)
    # Dump: the tree has its own mount namespace (memsnapctl run --own-proc). Restore: the image holds
    # one (its manifest's own_mntns, never this node's state). See _common_opts.
    own_mntns: bool = False
    # Established TCP connections not kept (no tcp_established): dumped without their state, and closed in
    # the restored copy (its peers see them reset, as after a restart). A restore of an image dumped so
    # must say it too (CRIU refuses it otherwise).
    tcp_close: bool = False
    # A container's tree (memsnap.containers): the root of its mount namespace (dump: the container's rootfs,
    # restore: the placeholder's); its cgroups are the runtime's, never CRIU's to dump or recreate.
    root: str = ""
    cgroups_ignore: bool = False
    log_level: int = 2


@dataclass(kw_only=True)
class DumpOptions(CriuOptions):
    """How to dump; the defaults suit a job that keeps running."""

    leave_running: bool = True
    leave_stopped: bool = False
    page_server: tuple[str, int] | None = None
    # A connected socket for the page server (a lazy dump serves its pages over it): no TCP port opens.
    ps_socket: int = -1
    # Connections still in a listener's accept queue (a busy server's in-flight ones) are left out of the
    # image instead of failing the dump; their clients see them reset, as after a server restart.
    skip_in_flight: bool = True


@dataclass(kw_only=True)
class RestoreOptions(CriuOptions):
    """How to restore; the root is always detached from CRIU."""

    inherit_fds: dict[str, int] = field(default_factory=dict)
    # Seconds without progress (memsnap.criuwatch) before the restore and its tasks are killed; 0: never.
    stall_s: float = field(default_factory=knobs.criu_stall_s)
    # Told criu swrk's pid once it runs, and 0 once it is gone (memsnap.lazyguard kills its tasks first).
    on_criu: Callable[[int], None] | None = None
    # A placeholder container's namespaces the tree joins (ns name -> an open fd on it), and the cgroup.procs
    # files criu swrk enters before it starts, so that the tree it forks is born in the placeholder's cgroups.
    join_ns: dict[str, int] = field(default_factory=dict)
    cgroup_procs: list[str] = field(default_factory=list)
    # An fd on a placeholder's PID namespace: CRIU runs inside it (with a /proc of its own), so that the tree it
    # restores becomes the placeholder init's child once CRIU exits, as a container's workload is; -1: not.
    pidns_fd: int = -1


@dataclass
class NotifyHandlers:
    """CRIU's notify callbacks, one typed field per script memsnap answers (runc's criuNotifications).

    Each handler returns None or True to let CRIU go on, False to make it abort (a dump then resumes the
    tree). Scripts without a handler are acknowledged. An instance is a NotifyCallback.
    """

    pre_dump: Callable[[], bool | None] | None = None  # the tree is about to freeze
    post_dump: Callable[[], bool | None] | None = None  # the image is complete, the tree still frozen
    post_restore: Callable[[int], bool | None] | None = None  # the tree exists again (its root pid)

    def __call__(self, script: str, pid: int) -> bool:
        if script == "pre-dump" and self.pre_dump is not None:
            return self.pre_dump() is not False
        if script == "post-dump" and self.post_dump is not None:
            return self.post_dump() is not False
        if script == "post-restore" and self.post_restore is not None:
            return self.post_restore(pid) is not False
        return True


class CriuApi(Protocol):
    """What memsnap needs of CRIU; Criu (criu swrk) implements it, tests use a fake."""

    def version(self) -> str:
        """CRIU's version as 'major.minor[.sublevel]'."""

    def lazy_pages_supported(self) -> bool:
        """Whether userfaultfd-based lazy pages work here."""

    def dump(self, pid: int, images_dir: Path, work_dir: Path, opts: DumpOptions,
             notify: NotifyCallback | None = None) -> DumpStats:
        """Dumps the tree rooted at pid into images_dir."""

    def restore(self, images_dir: Path, work_dir: Path, opts: RestoreOptions,
                notify: NotifyCallback | None = None) -> int:
        """Restores images_dir detached; the new root pid."""

    def start_lazy_pages(self, images_dir: Path, work_dir: Path, ps_socket: int = -1) -> subprocess.Popen[bytes]:
        """Starts the supervised `criu lazy-pages` server."""


def own_mount_ns(pid: int) -> bool:
    """Whether pid lives in a mount namespace other than ours (and so CRIU's, which runs in ours)."""
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return False


def find_binary() -> str:
    """The criu binary memsnap uses: $MEMSNAP_CRIU, else /usr/local/sbin/criu, else PATH."""
    env = knobs.criu_binary()
    if env:
        return env
    if os.access("/usr/local/sbin/criu", os.X_OK):
        return "/usr/local/sbin/criu"
    found = shutil.which("criu")
    if not found:
        raise CriuNotFound("locate", "criu is not installed; run scripts/install-criu.sh")
    return found


class Criu:
    """Runs one `criu swrk` per operation over a SOCK_SEQPACKET pair."""

    def __init__(self, binary: str | None = None, plugin_dir: Path | None = None) -> None:
        self.binary = binary or find_binary()
        self._version: str | None = None
        self._lazy_pages: bool | None = None
        # CRIU loads every plugin in its libdir; memsnap drives CUDA itself (see memsnap.gpu), so CRIU
        # gets an empty plugin dir and its cuda_plugin can never lock/unlock behind our back.
        self._env = dict(os.environ)
        if plugin_dir is not None:
            from memsnap.gpu.criuenv import criu_env  # checks that the dir is ours and holds no .so

            self._env = criu_env(plugin_dir, self._env)

    # -- transport ------------------------------------------------------------
    def _call(
        self,
        op: str,
        req: rpc.Req,
        pass_fds: tuple[int, ...] = (),
        notify: NotifyCallback | None = None,
        log_path: str = "",
        umask: int = -1,
        stall_s: float = 0.0,
        on_criu: Callable[[int], None] | None = None,
        cgroup_procs: tuple[str, ...] = (),
        pidns_fd: int = -1,
    ) -> rpc.Resp:
        """One request to a fresh `criu swrk`, its notify callbacks answered. stall_s > 0: CRIU that makes no
        progress for that long is killed with the tasks it holds (CriuStalled); on_criu hears its pid, then 0.
        cgroup_procs: criu swrk is moved into these cgroups before it gets the request. pidns_fd >= 0: it runs
        in that PID namespace (see RestoreOptions.pidns_fd), entered before anything forks."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [self.binary, "swrk", str(child.fileno())]
        if pidns_fd >= 0:
            argv = criu_in_ns.wrap(argv, pidns_fd, cgroup_procs)
            cgroup_procs = ()  # (entered by the wrapper itself: nsenter forks at once)
        try:
            proc = subprocess.Popen(
                argv,
                pass_fds=(child.fileno(), *pass_fds),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                close_fds=True,
                env=self._env,
                umask=umask,
            )
        except OSError as exc:
            parent.close()
            child.close()
            raise CriuNotFound(op, f"cannot run {self.binary}: {exc.strerror}") from exc
        child.close()
        try:
            if on_criu is not None:
                on_criu(proc.pid)
            for procs in cgroup_procs:
                try:
                    criu_in_ns.enter_cgroup(procs, proc.pid)
                except OSError as exc:
                    raise CriuError(op, f"cannot move criu into the cgroup {procs}: {exc.strerror}") from exc
            try:
                parent.send(req.SerializeToString())
            except (BrokenPipeError, ConnectionResetError):  # (it died first: in a placeholder that died, say)
                raise CriuError(op, "criu exited before its request" + self._stderr(proc), log_path) from None
            # (In a placeholder CRIU is not the wrapper's child: watch CRIU itself.)
            watched = criu_in_ns.criu_pid(pidns_fd) if pidns_fd >= 0 and stall_s > 0 else proc.pid
            watch = criuwatch.ProgressWatch(watched, stall_s) if stall_s > 0 and watched else None
            while True:
                if watch is not None:
                    self._await(parent, watch, op, log_path)
                try:
                    data, _anc, _flags, _addr = parent.recvmsg(_MAX_MSG, socket.CMSG_SPACE(struct.calcsize("i")))
                except ConnectionResetError:  # (CRIU died; in a container's PID namespace, with its init)
                    data = b""
                if not data:
                    raise CriuError(op, "criu exited without answering" + self._stderr(proc), log_path)
                resp = rpc.Resp()
                resp.ParseFromString(data)
                if resp.type != rpc.NOTIFY:
                    return resp
                ok = True
                if notify is not None:
                    try:
                        ok = bool(notify(resp.notify.script, resp.notify.pid))
                    except Exception:  # a failing handler aborts the operation instead of hanging CRIU
                        ok = False
                try:
                    parent.send(rpc.Req(type=rpc.NOTIFY, notify_success=ok).SerializeToString())
                except (BrokenPipeError, ConnectionResetError):
                    raise CriuError(op, "criu exited during its notify callback" + self._stderr(proc),
                                    log_path) from None
                if watch is not None:
                    watch.reset()  # (the time our callback took was not CRIU's)
        finally:
            parent.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                criuwatch.kill_with_tasks(proc.pid)
                proc.wait()
            if proc.stderr:
                proc.stderr.close()
            if on_criu is not None:
                on_criu(0)

    @staticmethod
    def _await(sock: socket.socket, watch: criuwatch.ProgressWatch, op: str, log_path: str) -> None:
        """Returns once CRIU's next message (or its exit) is there; kills it when it stopped making progress."""
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        while not poller.poll(500):
            if not watch.stalled():
                continue
            waits = criuwatch.lock_waits({watch.pid, *criuwatch.descendants(watch.pid)})
            criuwatch.kill_with_tasks(watch.pid)
            what = f": {'; '.join(waits)}" if waits else ""
            log.warning("criu %s (pid %d) made no progress for %.0f s%s; killed it and its tasks", op, watch.pid,
                        watch.idle_s(), what)
            raise CriuStalled(op, f"CRIU made no progress for {watch.idle_s():.0f} s (no CPU time, no context "
                                  f"switch, no message in criu or the tasks it restores){what}; it was killed, "
                                  "with the tasks it was restoring", log_path)

    @staticmethod
    def _stderr(proc: subprocess.Popen[bytes]) -> str:
        try:
            proc.wait(timeout=5)
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        except (subprocess.TimeoutExpired, OSError):
            return ""
        lines = [ln for ln in err.splitlines() if ln.strip() and not _HARMLESS.search(ln)]
        return f": {lines[-1].strip()}" if lines else ""

    def _fail(self, op: str, resp: rpc.Resp, log_path: str) -> CriuError:
        lines = error_lines(log_path)
        hint = hint_for(lines[0]) if lines else ""
        reason = "; ".join(lines) + (f" (hint: {hint})" if hint else "") if lines else resp.cr_errmsg or (
            f"errno {resp.cr_errno} ({os.strerror(resp.cr_errno)})" if resp.cr_errno else "unknown error"
        )
        return CriuError(op, reason, log_path, resp.cr_errno)

    # -- operations -----------------------------------------------------------
    def version(self) -> str:
        """CRIU's version as 'major.minor[.sublevel]'."""
        if self._version is None:
            resp = self._call("version", rpc.Req(type=rpc.VERSION))
            if not resp.success:
                raise CriuError("version", resp.cr_errmsg or "VERSION request failed")
            v = resp.version
            self._version = f"{v.major_number}.{v.minor_number}" + (f".{v.sublevel}" if v.sublevel else "")
        return self._version

    def lazy_pages_supported(self) -> bool:
        """Whether userfaultfd-based lazy pages work here (CRIU's feature check, asked once)."""
        if self._lazy_pages is None:
            req = rpc.Req(type=rpc.FEATURE_CHECK, features=rpc.Features(lazy_pages=True))
            resp = self._call("feature-check", req)
            self._lazy_pages = bool(resp.success and resp.features.lazy_pages)
        return self._lazy_pages

    def dump(
        self,
        pid: int,
        images_dir: Path,
        work_dir: Path,
        opts: DumpOptions,
        notify: NotifyCallback | None = None,
    ) -> DumpStats:
        """Dumps the tree rooted at pid into images_dir; the log goes to work_dir/dump.log."""
        log_path = str(work_dir / "dump.log")
        img_fd = os.open(images_dir, os.O_DIRECTORY | os.O_RDONLY | os.O_NOFOLLOW)  # CRIU works from this fd
        wd_fd = os.open(work_dir, os.O_DIRECTORY | os.O_RDONLY)
        try:
            o = _common_opts(img_fd, wd_fd, "dump.log", opts, notify)
            o.pid = pid
            if opts.own_mntns:
                skip = mounts.to_leave_out([p.pid for p in proc.tree(pid)])
                if skip:
                    log.info("pid %d: leaving mounts it does not use out of its image: %s", pid, ", ".join(skip))
                o.skip_mnt.extend(skip)
                if mounts.has_job_log(pid):  # (a restore binds a log of its own there: Engine.restore_own_log)
                    o.external.append(f"mnt[{mounts.JOB_LOG}]:{mounts.LOG_MOUNT_KEY}")
            o.leave_running = opts.leave_running and not opts.leave_stopped
            if opts.skip_in_flight:
                o.tcp_skip_in_flight = True
            if opts.leave_stopped:
                o.leave_stopped = True
            if opts.page_server:
                o.ps.address, o.ps.port = opts.page_server
            fds: tuple[int, ...] = (img_fd, wd_fd)
            if opts.ps_socket >= 0:
                # CRIU's RPC ignores criu_page_server_info.fd for lazy dumps (cr-service.c), but a config
                # file read after the RPC options may set ps-socket, as `criu dump --ps-socket` does.
                conf = work_dir / "ps-socket.conf"
                conf.write_text(f"ps-socket {opts.ps_socket}\n")
                o.config_file = str(conf)
                fds += (opts.ps_socket,)
            t0 = time.monotonic()
            # Images are never readable by others, not even between CRIU's open() and any later chmod:
            # criu swrk is a child process, so its own umask decides the mode its files are created with.
            resp = self._call("dump", rpc.Req(type=rpc.DUMP, opts=o), fds, notify, log_path, umask=0o077)
            wall_ms = (time.monotonic() - t0) * 1000
        finally:
            os.close(img_fd)
            os.close(wd_fd)
        if not resp.success:
            raise self._fail("dump", resp, log_path)
        return read_dump_stats(images_dir, work_dir, wall_ms)

    def restore(
        self,
        images_dir: Path,
        work_dir: Path,
        opts: RestoreOptions,
        notify: NotifyCallback | None = None,
    ) -> int:
        """Restores the image detached and returns the host pid of its root."""
        log_path = str(work_dir / "restore.log")
        img_fd = os.open(images_dir, os.O_DIRECTORY | os.O_RDONLY | os.O_NOFOLLOW)  # CRIU works from this fd
        wd_fd = os.open(work_dir, os.O_DIRECTORY | os.O_RDONLY)
        try:
            o = _common_opts(img_fd, wd_fd, "restore.log", opts, notify)
            for key, fd in opts.inherit_fds.items():
                o.inherit_fd.add(key=key, fd=fd)
            for ns, fd in opts.join_ns.items():  # (criu swrk gets the fd under the same number)
                o.join_ns.add(ns=ns, ns_file=f"/proc/self/fd/{fd}")
            fds = (img_fd, wd_fd, *opts.inherit_fds.values(), *opts.join_ns.values())
            if opts.pidns_fd >= 0:
                fds += (opts.pidns_fd,) if opts.pidns_fd not in fds else ()
                conf = work_dir / "in-pidns.conf"
                conf.write_text(criu_in_ns.config(img_fd, wd_fd))
                o.config_file = str(conf)
            resp = self._call("restore", rpc.Req(type=rpc.RESTORE, opts=o), fds, notify, log_path,
                              stall_s=opts.stall_s, on_criu=opts.on_criu, cgroup_procs=tuple(opts.cgroup_procs),
                              pidns_fd=opts.pidns_fd)
        finally:
            os.close(img_fd)
            os.close(wd_fd)
        if not resp.success:
            raise self._fail("restore", resp, log_path)
        if opts.pidns_fd >= 0:  # (CRIU ran in the placeholder's PID namespace: that is the pid it reports)
            pid = criu_in_ns.host_pid(int(resp.restore.pid), opts.pidns_fd)
            if not criu_in_ns.wait_criu_gone(opts.pidns_fd):
                log.warning("criu is still in the placeholder's PID namespace 10 s after its restore answered")
            if not pid:
                raise CriuError("restore", f"the restored tree's root (pid {resp.restore.pid} in its container) is "
                                           "gone", log_path)
            return pid
        return int(resp.restore.pid)

    def start_lazy_pages(self, images_dir: Path, work_dir: Path, ps_socket: int = -1) -> subprocess.Popen[bytes]:
        """Starts the `criu lazy-pages` daemon that serves faults for a lazy restore.

        Without ps_socket it reads the pages from images_dir; with ps_socket (a connected socket to the
        source's lazy dump) it fetches them from there. It runs under a supervisor shell that outlives
        memsnapd: if lazy-pages fails, the shell kills the restored job (work_dir/job.pid), whose missing
        pages would otherwise read as zeros once userfaultfd is gone. The exit code lands in
        work_dir/lazy-pages.rc.
        """
        cmd = [self.binary, "lazy-pages", "-D", str(images_dir), "-W", str(work_dir),
               "-o", "lazy-pages.log", "-v2"]
        fds: tuple[int, ...] = ()
        if ps_socket >= 0:
            cmd += ["--page-server", "--ps-socket", str(ps_socket)]
            fds = (ps_socket,)
        return subprocess.Popen(["/bin/sh", "-c", _LAZY_SUPERVISOR, "memsnap-lazy-pages", str(work_dir), *cmd],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, env=self._env, pass_fds=fds)


def guard_lazy_restore(work_dir: Path, pid: int) -> str:
    """Hands the restored job's pid to its lazy-pages supervisor; returns lazy-pages' exit code if it has
    already failed ("" while it runs or after it succeeded), in which case the caller must kill pid.

    The supervisor writes lazy-pages.rc before it reads job.pid, and this writes job.pid before it reads
    the rc: one of the two sees the other, so a lazy-pages failing in between cannot leave the job running
    on zero pages.
    """
    (work_dir / "job.pid").write_text(f"{pid}\n")
    try:
        rc = (work_dir / "lazy-pages.rc").read_text().strip()
    except FileNotFoundError:
        return ""
    return "" if rc == "0" else rc


# $1 = work dir, then the lazy-pages command. A failed transfer kills the restored job's pid namespace
# (its root is the namespace's init), so no copy with missing pages ever runs on. lazy-pages runs at nice 10:
# while a page is on its way it spins (epoll with a zero timeout), and at the same priority it took a core from
# the page server and the job, whose faults then waited (first tick 0.9-2.3 s after a lazy restore in 4 of 8
# runs on a loaded 2-core node; 0.00 s in 8 of 8 at nice 10, every page resident as fast).
_LAZY_SUPERVISOR = """w=$1; shift
nice -n 10 "$@"; rc=$?
echo "$rc" > "$w/lazy-pages.rc.tmp" && mv "$w/lazy-pages.rc.tmp" "$w/lazy-pages.rc"
if [ "$rc" -ne 0 ] && [ -s "$w/job.pid" ]; then kill -KILL "$(cat "$w/job.pid")" 2>/dev/null; fi
exit "$rc"
"""


def pipe_size_problem() -> str:
    """Why a lazy dump's page server would fail here, or "".

    It sizes its pipes to PIPE_MAX_SIZE pages (about 3.2 MiB), which needs CAP_SYS_RESOURCE or
    fs.pipe-max-size at least that big; CRIU 4.1 ignores the failure and then fails with EBADF.
    """
    need = 4 << 20
    try:
        cap_eff = int(next(ln.split()[1] for ln in Path("/proc/self/status").read_text().splitlines()
                           if ln.startswith("CapEff:")), 16)
        if cap_eff & (1 << 24):  # CAP_SYS_RESOURCE
            return ""
        have = int(Path("/proc/sys/fs/pipe-max-size").read_text())
    except (OSError, StopIteration, ValueError):
        return ""
    if have >= need:
        return ""
    return (f"lazy moves need CAP_SYS_RESOURCE or fs.pipe-max-size >= {need} (it is {have}); "
            f"run 'sysctl -w fs.pipe-max-size={need}' on this node")


def _common_opts(img_fd: int, wd_fd: int, log_file: str, opts: DumpOptions | RestoreOptions,
                 notify: NotifyCallback | None) -> rpc.Opts:
    """The options a dump and a restore share."""
    o = rpc.Opts(images_dir_fd=img_fd, work_dir_fd=wd_fd, log_file=log_file, log_level=opts.log_level,
                 tcp_established=opts.tcp_established, shell_job=opts.shell_job, ext_unix_sk=opts.ext_unix_sk,
                 file_locks=opts.file_locks, notify_scripts=notify is not None, external=opts.external)
    if opts.tcp_close or (isinstance(opts, DumpOptions) and not opts.tcp_established):
        o.tcp_close = True
    if opts.tcp_established and opts.network_lock_skip:
        o.network_lock = rpc.SKIP
    elif opts.tcp_established and opts.network_lock_nft:
        o.network_lock = rpc.NFTABLES
    if opts.lazy_pages:
        o.lazy_pages = True
    if opts.cgroups_ignore:
        o.manage_cgroups_mode = rpc.IGNORE
    if opts.root:
        # A container (memsnap.containers): its network namespace is external (the placeholder's on restore),
        # so there is nothing of ours to lock; its mount namespace is rebuilt on this root.
        o.root = opts.root
        o.network_lock = rpc.SKIP
    elif opts.own_mntns:
        # A job's own mount namespace is a copy of ours plus a fresh procfs on /proc. auto_ext_mnt makes
        # every mount that binds one of ours (/, /dev, /dev/shm, /sys, cgroups...) external: never dumped
        # (no tmpfs tarball of /dev/shm in the image), bound back from the same path on restore, which
        # CRIU refuses without it ("autodetected external mount"). Only the job's procfs is dumped and
        # recreated. The job's mounts are slaves of ours (unshare --propagation slave): on dump,
        # ext_masters/ext_sharing let CRIU record those links ("unreachable sharing" otherwise).
        o.auto_ext_mnt = True
        if isinstance(opts, RestoreOptions):
            # The namespace's root is our "/". Without root, CRIU 4.1 first unmounts the cloned tree and
            # crashes doing so with the mount-v2 engine (BUG at mount.c:48).
            o.root = "/"
        else:
            o.ext_masters = o.ext_sharing = True
    return o


def read_dump_stats(images_dir: Path, work_dir: Path, wall_ms: float) -> DumpStats:
    """Parses CRIU's stats-dump image (magic header, then one length-prefixed protobuf).

    CRIU writes it to the work dir, which keeps it out of the image we checksum and ship.
    """
    stats = DumpStats(wall_ms=wall_ms)
    try:
        stats.bytes_written = sum(p.stat().st_size for p in images_dir.iterdir() if p.is_file())
        src = work_dir / "stats-dump"
        data = (src if src.exists() else images_dir / "stats-dump").read_bytes()
    except OSError:
        return stats
    # Image files start with one or two 4-byte magics; stats images use a single one.
    for off in (4, 8):
        if len(data) < off + 4:
            continue
        (size,) = struct.unpack_from("<I", data, off)
        if off + 4 + size > len(data):
            continue
        entry = stats_pb.StatsEntry()
        try:
            entry.ParseFromString(data[off + 4 : off + 4 + size])
        except Exception:  # protobuf's DecodeError; try the other header length
            continue
        if entry.HasField("dump"):
            d = entry.dump
            stats.freezing_ms = d.freezing_time / 1000
            stats.frozen_ms = d.frozen_time / 1000
            stats.memdump_ms = d.memdump_time / 1000
            stats.memwrite_ms = d.memwrite_time / 1000
            stats.pages_written = d.pages_written
            stats.pages_lazy = d.pages_lazy
            break
    return stats
