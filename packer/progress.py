"""Progress of long work for a person at a terminal (`packer` and `bench`): a tqdm bar, or a
plain line now and then into a pipe or log, or nothing under CI; and sizes as people read them."""

from __future__ import annotations

import os
import sys
import time


def show_progress() -> bool:
    """Bars only for a person at a terminal: not under CI, not into a pipe or file."""
    return sys.stderr.isatty() and not os.environ.get("CI")


class ProgressBar:
    """Progress of `unit`s: a tqdm bar (rate, ETA) on a terminal; a plain line every
    LINE_EVERY_S seconds into a pipe or log; nothing under CI or when disabled (--quiet)."""

    LINE_EVERY_S = 30.0

    def __init__(self, desc: str, enabled: bool, unit: str = "rec"):
        self.desc, self.unit, self.bar = desc, unit, None
        self.mode = "off" if not enabled or os.environ.get("CI") else ("bar" if show_progress() else "lines")
        self.started = self.last_line = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if self.mode == "bar":
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, dynamic_ncols=True, leave=False)
            self.bar.update(done - self.bar.n)
        elif self.mode == "lines" and time.monotonic() - self.last_line >= self.LINE_EVERY_S:
            self.last_line = now = time.monotonic()
            rate = done / max(now - self.started, 1e-9)
            eta = (total - done) / rate if rate else float("inf")
            print(f"{self.desc}: {done:,}/{total:,} {self.unit} ({rate:,.0f}/s, ETA {eta:,.0f} s)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"
