"""Pool worker processes: how each starts (`init_worker`, the pool's initializer), how it dies
with the build, and the staging's workers lock that tells a later build they are all gone.

A build killed with `kill -9` must not leave workers writing into a staging dir that the next
build of the same OUT uses. So every worker dies with its parent (PR_SET_PDEATHSIG) and with
the build process itself (a pidfd; a forkserver's worker has the server as its parent), and
holds the workers lock shared for its whole life; a build takes it exclusively, once, before it
writes (`wait_for_old_workers`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from packer.errors import ConfigError
from packer.builder.shard import set_progress_sink
from packer.system import flock, linux_libc, process_alive


def init_worker(queue, rayon_threads: int | None, build_pid: int | None = None, staging: Path | None = None) -> None:
    """Pool worker initializer: dies with the build process (`build_pid`: its parent may be a
    forkserver), holds the staging's workers lock shared for life (so a build started after this
    one was killed waits for it to be gone), progress to the parent's queue; tokenizers' Rust
    pool sized so that N workers do not oversubscribe the cores (set before its first use)."""
    _die_with_parent()
    if build_pid is not None:
        die_with(build_pid)
    if staging is not None:
        _held.append(hold_workers_lock(staging))
    if rayon_threads:
        os.environ["RAYON_NUM_THREADS"] = str(rayon_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    set_progress_sink(queue.put if queue is not None else None)
    from packer.builder.forms import read

    read.in_worker()


_held: list = []  # the workers lock of this worker process, open for its whole life


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when its parent goes (a `kill -9` of the build), so no orphan
    keeps writing into a staging dir that a restarted build is using."""
    import signal

    prctl = linux_libc("prctl")
    if prctl is not None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def die_with(pid: int) -> None:
    """SIGKILL this process as soon as process `pid` ends: a thread waits on a pidfd (Linux 5.3;
    elsewhere it looks every WATCH_S). PR_SET_PDEATHSIG alone watches only the parent, which for
    a forkserver's worker is the server, not the build."""
    import select
    import signal
    import threading

    def kill_me() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        kill_me()
    except (AttributeError, OSError):
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has exited
        else:
            while process_alive(pid):
                time.sleep(WATCH_S)
        kill_me()

    threading.Thread(target=watch, daemon=True, name="mmpack-watch-build").start()


WATCH_S = 0.2


def workers_lock_path(staging: Path) -> Path:
    return staging / "workers.lock"


def hold_workers_lock(staging: Path):
    """A shared flock on the staging's workers lock, held until this process ends."""
    f = open(workers_lock_path(staging), "a")
    flock(f, shared=True)
    return f


def wait_for_old_workers(staging: Path, timeout_s: float = 30.0) -> None:
    """Before a build writes: no worker of an earlier build of this OUT (killed, its workers
    not yet gone) is alive. They hold the workers lock shared; this takes it exclusively once."""
    staging.mkdir(parents=True, exist_ok=True)
    with open(workers_lock_path(staging), "a") as f:
        deadline = time.monotonic() + timeout_s
        while not flock(f, block=False):
            if time.monotonic() > deadline:
                raise ConfigError(f"{staging.parent}: worker processes of an earlier build still run after "
                                  f"{timeout_s:.0f} s; stop them (fuser {workers_lock_path(staging)}), then "
                                  "run this again")
            time.sleep(0.05)
