"""One lazy restore's tasks die before their pages' source goes away: no task ever reads a page that is not
its own.

    criu restore (swrk) ──forks──> the tasks: their lazy memory registered with userfaultfd
    criu lazy-pages (its supervisor shell around it) holds their uffds; a fault asks the page source:
        the tier copy, the store (memsnap.pageserver) or the source node (memsnap.move.tunnel)

Once lazy-pages' uffds are gone, a missing page reads as zeros. So when the page source fails (the store, the
tunnel, a page that does not verify) or lazy-pages stops making progress, fail(why) runs, in this order:

    1. kill the tasks: the restored tree (its root is known from CRIU's post-restore callback on, before it
       runs), and every descendant of criu swrk while CRIU still restores (its restore then fails and
       returns; a CRIU that does not is killed 5 s later)
    2. only then end lazy-pages (SIGKILL; never an EOF on its page-server socket: CRIU 4.1.1's lazy-pages dies
       on a BUG_ON when that socket turns readable with no request outstanding)

The supervisor shell stays as the backstop for a daemon that died: it kills the job once lazy-pages failed.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import psutil

from memsnap import criuwatch, knobs, proc
from memsnap.criu import NotifyCallback

log = logging.getLogger("memsnap.engine")

_CRIU_GRACE_S = 5.0  # how long CRIU may take to give up once its tasks were killed


class LazyGuard:
    """The tasks of one lazy restore, and the order in which they and their lazy-pages end on a failure."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.server: Any = None  # lazy-pages' supervisor shell (subprocess.Popen)
        self.criu_pid = 0  # criu swrk, while it restores
        self.pid = 0  # the restored root, from CRIU's post-restore callback on
        self.why = ""  # fail() ran: why
        self._lock = threading.Lock()

    # -- what the restore tells it ---------------------------------------------------------------
    def on_criu(self, pid: int) -> None:
        """RestoreOptions.on_criu: criu swrk's pid (0 once it is gone)."""
        with self._lock:
            self.criu_pid = pid
            failed = self.why
        if pid and failed:  # (the pages' source failed before CRIU even started: it restores nothing)
            criuwatch.kill_with_tasks(pid)

    def notify(self, inner: NotifyCallback | None) -> NotifyCallback:
        """CRIU's callbacks for this restore: inner's, and the restored root's pid at post-restore (the tasks
        do not run yet)."""

        def callback(script: str, pid: int) -> bool:
            if script == "post-restore":
                with self._lock:
                    self.pid = pid
                    if self.why:
                        return False  # (CRIU aborts and kills the tree)
            return inner(script, pid) if inner is not None else True

        return callback

    def restored(self, pid: int) -> str:
        """CRIU returned pid: from now on its lazy-pages is watched for progress. Returns why the restore
        failed meanwhile ("" if it did not), in which case pid was killed."""
        with self._lock:
            self.pid = pid
            why = self.why
        if why:
            proc.kill_tree(pid)
            return why
        threading.Thread(target=self._watch_progress, name=f"lazy-progress-{self.name}", daemon=True).start()
        return ""

    # -- failure ---------------------------------------------------------------------------------
    def fail(self, why: str) -> bool:
        """Kills the tasks, then lazy-pages (see the module's doc); False if it ran before."""
        with self._lock:
            if self.why:
                return False
            self.why = why
            pid, criu = self.pid, self.criu_pid
        if criu and (waits := criuwatch.lock_waits({criu, *criuwatch.descendants(criu)})):
            self.why = why = f"{why}; CRIU's restore was waiting meanwhile: {'; '.join(waits)}"
        log.warning("lazy restore %s: %s; killing its tasks, then lazy-pages", self.name, why)
        if criu:
            criuwatch.kill_tasks(criu)
        if pid:
            proc.kill_tree(pid)
        self.end_lazy_pages()
        if criu:
            threading.Thread(target=self._end_criu, args=(criu,), name=f"lazy-criu-{self.name}",
                             daemon=True).start()
        return True

    def _end_criu(self, criu: int) -> None:
        """Kills what CRIU forks after fail(), and CRIU itself if it has not given up within the grace."""
        deadline = time.monotonic() + _CRIU_GRACE_S
        while time.monotonic() < deadline:
            with self._lock:
                if self.criu_pid != criu:
                    return
            criuwatch.kill_tasks(criu)
            time.sleep(0.05)
        with self._lock:
            if self.criu_pid == criu:
                log.warning("lazy restore %s: criu (pid %d) did not give up once its tasks were killed; "
                            "killing it", self.name, criu)
                criuwatch.kill_with_tasks(criu)

    def lazy_pages_pid(self) -> int:
        """lazy-pages itself (the supervisor shell's child), or 0."""
        server = self.server
        if server is None or server.poll() is not None:
            return 0
        try:
            kids = psutil.Process(server.pid).children()
        except psutil.Error:
            return 0
        return kids[0].pid if kids else 0

    def end_lazy_pages(self) -> None:
        """SIGKILLs lazy-pages itself; its supervisor shell records the exit and ends too."""
        server = self.server
        if server is None or server.poll() is not None:
            return
        try:
            for child in psutil.Process(server.pid).children():
                child.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass

    def _watch_progress(self) -> None:
        """Fails the restore once no page arrived for MEMSNAP_CRIU_STALL_S (the tasks' resident memory did not
        change): lazy-pages pushes every page in the background until it exits, so that means it hangs.
        (Not its CPU time: lazy-pages spins while it waits for a page.)"""
        stall_s = knobs.criu_stall_s()
        if stall_s <= 0:
            return
        watch = criuwatch.ProgressWatch(self.pid, stall_s, probe=_resident)
        while self.server is not None and self.server.poll() is None and not self.why:
            if watch.stalled():
                self.fail(f"no page arrived for {watch.idle_s():.0f} s (lazy-pages pid {self.lazy_pages_pid()}, "
                          "or its page source, hangs)")
                return
            time.sleep(min(1.0, stall_s / 4))


def _resident(pid: int) -> int:
    try:
        return proc.tree_rss(pid)
    except proc.ProcessNotFound:
        return -1


__all__ = ["LazyGuard"]
