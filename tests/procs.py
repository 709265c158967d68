"""A real `packer build` subprocess killed with SIGKILL mid-build, shared by the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from packer.builder.workers import wait_for_old_workers
from packer.dataset import format as fmt


def kill_mid_build(raw: Path, out: Path, args: list[str], *, settle: bool = True, group: bool = False) -> None:
    """SIGKILL the build once one shard is whole in staging and another is being written (the
    build process alone, or with `group` its whole process group). `settle`: wait for its pool
    workers to go too (see the end)."""
    proc = subprocess.Popen([sys.executable, "-m", "packer", "build", str(raw), str(out), "-q", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=group)
    staging, deadline = out / fmt.STAGING_DIR, time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        names = [p.name for p in staging.iterdir()] if staging.is_dir() else []
        if any(n.endswith(".partial") for n in names) and any(n.startswith("shard-") and n.endswith(".json") for n in names):
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the build finished before it could be killed; use more input"
    (os.killpg if group else os.kill)(proc.pid, signal.SIGKILL)
    proc.wait()
    # its pool workers get SIGKILL (PR_SET_PDEATHSIG) once the forkserver notices its parent is
    # gone, a few ms later. A build resumed at once, or an --overwrite, waits for them on the
    # shard locks (settle=False tests the resume); `settle` keeps other tests clear of that
    if settle:
        wait_for_old_workers(out / fmt.STAGING_DIR)
