"""Facts about the machine the packer runs on."""

from __future__ import annotations

import os
import sys


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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
