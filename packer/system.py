"""Facts about the machine the packer runs on."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import shutil
import sys
from collections.abc import Iterator

# Size units of every size a user writes (--shard-size, cache_limit), case-insensitive: binary,
# as the build has always read them ("64MB" is 64 MiB)
SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2, "mib": 1024**2,
              "g": 1024**3, "gb": 1024**3, "gib": 1024**3, "t": 1024**4, "tb": 1024**4, "tib": 1024**4}


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def local_ranks() -> int:
    """The ranks of this job on this node (LOCAL_WORLD_SIZE, as torchrun sets it; 1 without
    it): what share the node's cores and cache each rank takes."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def linux_libc(name: str):
    """The C library's function `name` through ctypes, on Linux; None elsewhere or when this
    libc lacks it (callers treat it as an optional speed-up or safety net)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a while (then as it was): while a scan and plan
    make a few objects for every input file, none of them in a cycle, its passes over the
    growing heap took a third of the time to prepare a build of 100,000 files."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Every object that exists now kept out of the collector's passes until the block ends,
    in this process and in the processes it forks (whose passes would otherwise write to each
    object and copy its page). Where objects are frozen already (an outer freeze of ours, the
    caller's, or an interpreter that starts so), it changes nothing: the collector has no partial
    unfreeze, so only the one who froze first may unfreeze."""
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def single_threaded() -> bool:
    """Whether this process runs one thread (Linux's /proc/self/task; False where unknown): then
    a fork cannot leave a lock held by a thread the child lacks."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


class ChildDied(Exception):
    """A forked child (`in_forked_child`) ended without an answer: killed, or crashed in C."""

    def __init__(self, exitcode: int | None):
        self.exitcode = exitcode
        how = f"signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit {exitcode}"
        super().__init__(f"the process doing it died ({how})")


def in_forked_child(fn, *args):
    """fn(*args) in a child forked from this process, its result or exception sent back
    pickled; ChildDied when it ends without one. For work whose libraries start threads in the
    process that imports them (pyarrow does at import), which would keep this process from
    forking its build workers later. Linux, from a single-threaded process; elsewhere the
    caller runs fn itself, as this does in a daemonic process (which may have no children)."""
    import multiprocessing

    if multiprocessing.current_process().daemon:  # (a daemonic process may have no children): here
        return fn(*args)
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_answer, args=(send, fn, args), daemon=True)
    child.start()
    send.close()
    try:
        ok, value = recv.recv()
    except EOFError:
        child.join()
        raise ChildDied(child.exitcode) from None
    finally:
        recv.close()
    child.join()
    if ok:
        return value
    raise value


def _answer(conn, fn, args) -> None:
    try:
        answer = (True, fn(*args))
    except BaseException as exc:  # noqa: BLE001 - the caller's to raise, as if fn had run there
        answer = (False, exc)
    try:
        conn.send(answer)
    except Exception as exc:  # noqa: BLE001 - an exception that does not pickle: its words do
        conn.send((False, RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}" if not answer[0] else str(exc))))


NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # file systems without flock (some NFS)


def flock(f, *, shared: bool = False, block: bool = True) -> bool:
    """An flock on the open file `f`; False only when `block` is False and another process holds
    it. Where the file system has no flock, True: every lock of mmpack goes unlocked there."""
    import fcntl

    try:
        fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if block else fcntl.LOCK_NB))
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and not block:
            return False
        if exc.errno in NO_FLOCK:
            return True
        raise


def process_alive(pid: int) -> bool:
    """Whether a process `pid` runs (one of another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def link_or_copy(src, dst) -> None:
    """dst as a hard link to src, or a copy where links are not possible (another file system,
    a file system without them)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
