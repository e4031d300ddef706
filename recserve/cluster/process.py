"""Child processes that die with their parent: the one launcher of server processes.

A server started by a test, a benchmark or ``recserve demo`` must not outlive its parent:
when CI cancels a job it SIGKILLs the runner, which gets no chance to stop anything, and
orphaned shards keep ports, RocksDB locks and CPU. Every child is therefore launched by
:func:`spawn_child` and, as its first act, calls :func:`exit_with_parent` (``recserve``'s
``main`` does so for every subcommand, so a server entrypoint gets it for free).

Two mechanisms, because each has a hole the other covers:

* **Lifeline pipe** (always). The parent keeps the write end of a pipe per child; the
  child inherits only the read end (``pass_fds``) and a daemon thread blocks reading it.
  The kernel closes the write end when the parent *process* dies, however it dies, so
  the read returns EOF. No race: if the parent died before the child got to watch, the
  read returns EOF at once. Both ends are non-inheritable elsewhere (PEP 446), so no
  sibling holds another child's lifeline open.
* **``prctl(PR_SET_PDEATHSIG, SIGTERM)``** (Linux, when spawned from the main thread).
  The kernel signals the child the moment its parent dies, even while the child is busy
  in C code and before Python could run the watchdog. Caveat: PDEATHSIG fires when the
  *thread* that forked the child exits, not the process, so a child spawned from a
  worker thread would be killed when that thread ends; it is only armed for children of
  the main thread (CPython's main thread lives as long as the process). The child sets
  it itself at start-up (no ``preexec_fn``, which is unsafe with threads) and then
  compares ``os.getppid()`` with the parent pid it was given (and checks that pid is
  gone), closing the window in which the parent died before the flag was set.

On parent death the child gets SIGTERM (its graceful shutdown: a shard stops serving and
closes RocksDB) and, if still alive after ``ORPHAN_GRACE_S``, SIGKILL.

Example::

    child = spawn_child([sys.executable, "-m", "recserve", "shard", "serve", ...], env=env, log_file=path)
    child.stop()          # SIGTERM, SIGKILL after the grace, reaped, lifeline closed
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

PARENT_PID_ENV = "RECSERVE_PARENT_PID"
LIFELINE_FD_ENV = "RECSERVE_LIFELINE_FD"
PDEATHSIG_ENV = "RECSERVE_PDEATHSIG"
ORPHAN_GRACE_S = 1.0  # SIGTERM -> SIGKILL when an orphan does not stop by itself
STOP_GRACE_S = 5.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class ChildProcess:
    """A launched child: its ``Popen``, the parent's end of its lifeline and its log."""

    def __init__(self, popen: subprocess.Popen[bytes], lifeline_fd: int, log_file: IO[bytes] | None) -> None:
        self.popen = popen
        self._lifeline_fd: int | None = lifeline_fd
        self._log_file = log_file
        self._terminated = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def send_signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def terminate(self) -> None:
        """SIGTERM, once: a second one could land after the child's handler is gone."""
        if not self._terminated:
            self._terminated = True
            self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL and reap (the lifeline stays open until :meth:`close`)."""
        self.send_signal(signal.SIGKILL)
        self.popen.wait()

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """SIGTERM, SIGKILL if it outlives ``grace_s``; reap, close; the exit code."""
        self.terminate()
        try:
            code = self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("child %d ignored SIGTERM for %.1f s; killing it", self.pid, grace_s)
            self.popen.kill()
            code = self.popen.wait()
        self.close()
        return code

    def close(self) -> None:
        """Release the lifeline and the log file. Closing the lifeline of a live child
        tells it its parent is gone (it stops), so call this once it has exited."""
        if self._lifeline_fd is not None:
            os.close(self._lifeline_fd)
            self._lifeline_fd = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def lifeline_env(base: Mapping[str, str], read_fd: int) -> dict[str, str]:
    """``base`` plus what :func:`exit_with_parent` reads in the child: this pid, the
    lifeline's fd and, only when called from the main thread, the PDEATHSIG request
    (a worker thread's exit would fire it, see the module docstring)."""
    env = dict(base)
    env[PARENT_PID_ENV] = str(os.getpid())
    env[LIFELINE_FD_ENV] = str(read_fd)
    if threading.current_thread() is threading.main_thread():
        env[PDEATHSIG_ENV] = "1"
    else:
        env.pop(PDEATHSIG_ENV, None)
    return env


def spawn_child(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    log_file: str | Path | None = None,
    cwd: str | Path | None = None,
) -> ChildProcess:
    """Start ``argv`` (``subprocess``, never ``fork`` of this process: gRPC and fork do
    not mix) as a child that exits when this process dies, once it has called
    :func:`exit_with_parent`. ``env`` defaults to this process's environment; stdout and
    stderr append to ``log_file`` (default: inherited)."""
    read_fd, write_fd = os.pipe()  # both non-inheritable; pass_fds hands the child only read_fd
    child_env = lifeline_env(os.environ if env is None else env, read_fd)
    log_fh = open(log_file, "ab") if log_file is not None else None  # append: restarts keep history
    try:
        popen = subprocess.Popen(
            list(argv), env=child_env, cwd=None if cwd is None else str(cwd), pass_fds=(read_fd,),
            stdout=log_fh, stderr=subprocess.STDOUT if log_fh is not None else None,
        )  # fmt: skip
    except BaseException:
        os.close(write_fd)
        if log_fh is not None:
            log_fh.close()
        raise
    finally:
        os.close(read_fd)  # the child has its copy; ours would keep our own lifeline readable
    return ChildProcess(popen, write_fd, log_fh)


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _orphaned(grace_s: float) -> None:
    """The parent is gone: stop gracefully (SIGTERM), or be killed after ``grace_s``."""
    log.warning("parent process died; stopping (SIGTERM, SIGKILL after %.1f s)", grace_s)
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(grace_s)  # still alive: the graceful stop hangs
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(fd: int, grace_s: float) -> None:
    try:
        while os.read(fd, 1):  # the parent never writes: any return is EOF or a misuse
            pass
    except OSError:
        pass
    _orphaned(grace_s)


def exit_with_parent(*, grace_s: float = ORPHAN_GRACE_S) -> bool:
    """Arm the death-with-parent mechanisms :func:`spawn_child` asked for; a no-op
    (False) in a process that was not started by it. Call once, first thing in a child
    entrypoint. The environment variables are removed so this process's own children
    do not mistake them for theirs."""
    parent_pid = os.environ.pop(PARENT_PID_ENV, None)
    fd_text = os.environ.pop(LIFELINE_FD_ENV, None)
    pdeathsig = os.environ.pop(PDEATHSIG_ENV, None) == "1"
    if parent_pid is None or fd_text is None:
        return False
    try:
        fd = int(fd_text)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise OSError(f"fd {fd} is not a pipe")
    except (OSError, ValueError) as exc:
        log.warning("%s=%s is not a lifeline pipe (%s); not watching the parent", LIFELINE_FD_ENV, fd_text, exc)
        return False
    os.set_inheritable(fd, False)  # grandchildren must not hold our lifeline
    if pdeathsig and _set_pdeathsig(signal.SIGTERM) and os.getppid() != int(parent_pid) and not _alive(int(parent_pid)):
        # Re-parented and the launcher is gone: it died before the flag was set, so the
        # signal will never come. (A live launcher behind a wrapper, e.g. a shell, is
        # not an orphan: the lifeline covers that case.)
        _orphaned(grace_s)
    threading.Thread(target=_watch, args=(fd, grace_s), name="lifeline", daemon=True).start()
    return True
