"""Deadlines: nothing the doctor runs may hang it. A DataLoader worker stuck on one item blocks
`next()` for ever, in the script's loop and again in the doctor's own runs of the loader alone
(they reach the same item). So the loop has a watchdog (no batch and no optimizer step for the
deadline: the report of what ran is written and the script stopped) and every probe and trial
runs `bounded` (no answer by the deadline: a Failure saying so, and the trials after it, which
would reach the same item, are not run)."""

from __future__ import annotations

import os
import threading
import time

from .report import Failure

DEADLINE_ENV = "MMPACK_DOCTOR_DEADLINE"
DEADLINE_S = 300.0  # longer than any one batch, epoch start or optimizer step a script should take
STALLED_EXIT = 124  # the status of a script the doctor stopped for want of progress (as `timeout` gives)


def limit_s() -> float:
    """The deadline in force: `bench doctor --deadline`, passed to the child by the environment."""
    got = os.environ.get(DEADLINE_ENV)
    return float(got) if got else DEADLINE_S


class Hung(Failure):
    """A probe or trial that gave no answer by the deadline."""


def bounded(fn, *args, what: str):
    """`fn(*args)`, or a `Hung` failure naming `what` where it has not returned by the deadline. It
    runs in a daemon thread, left behind where it hangs: what it holds (a stuck worker) ends with
    the process, and the doctor ends the script's whole process group."""
    box: dict = {}

    def call():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - given to the caller's thread
            box["error"] = exc
    thread = threading.Thread(target=call, daemon=True, name="mmpack-doctor-probe")
    thread.start()
    thread.join(limit_s())
    if thread.is_alive():
        return Hung(error=f"{what} gave no answer in {limit_s():g} s (an item that never returns, a stuck worker?); "
                          "the trials that would reach it were not run")
    if "error" in box:
        raise box["error"]
    return box["value"]


class Watchdog:
    """Calls `stalled()` once, from its own thread, where the loop has made no progress (`progress()`:
    a batch asked for or handed over, an optimizer step) for the deadline since it began."""

    def __init__(self, stalled):
        self.stalled, self.at = stalled, None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="mmpack-doctor-watchdog")
        self.thread.start()

    def progress(self) -> None:
        self.at = time.monotonic()

    def _run(self) -> None:
        limit = limit_s()
        while not self.stop.wait(min(1.0, limit / 4)):
            if self.at is not None and time.monotonic() - self.at > limit:
                self.stalled(limit)
                return
