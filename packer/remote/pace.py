"""Requests at a rate the store accepts: every request of this process goes through `call`,
which tries it again (jittered, until the deadline) and paces them all.

S3 answers 503 SlowDown while it scales a prefix (about 5,500 GETs/s each); a job of many ranks
that only backs off each request keeps the store busy with retries, and its throughput stays
down after the burst. So this process keeps a window of requests it lets in flight, as TCP keeps
its congestion window: half the requests in flight on a throttling answer (once per HOLD_S,
however many of them meet the same burst), grown by one for each window of answers that came back well,
up to the cap (MMPACK_REMOTE_REQUESTS, default CAP). MMPACK_REMOTE_RATE caps the requests a
second it starts, for a job that shares a prefix's rate among its processes. A throttled or
failed request waits a random time up to a doubling backoff (full jitter, so the ranks that met
one burst do not come back together) and is made again by the same thread: a download in
progress is never duplicated (the cache's lock holds other processes off the file meanwhile).
The store client makes one try per call (`client.retry_config`): only here are tries counted.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time

from packer.errors import ConfigError, IntegrityError

CAP = 64  # requests in flight at most, per process
HOLD_S = 0.5  # one halving per burst: the answers of requests already in flight come within it
BACKOFF_S = (0.1, 5.0)  # the first retry's most wait, and the longest
# what a store says when it throttles: S3 503 SlowDown, Azure 503 ServerBusy, GCS and others 429
THROTTLED_STATUS = (429, 503)
THROTTLED = ("<Code>SlowDown<", "<Code>ServerBusy<", "<Code>TooManyRequests<", "<Code>RequestLimitExceeded<")
# the answer's status in the client's message (never a number of the URL: a shard may be named 00503)
_STATUS = re.compile(r"status code: (\d{3})")


def setting(name: str, default, what: str):
    """The positive number the environment variable `name` holds, else `default`; anything else
    is one line saying to give `what`."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{name}={text!r}: give {what}")
    return value


class Pace:
    """The window of requests in flight (see the module), and what it met, for a report."""

    def __init__(self, cap: int = CAP, rate: float | None = None, clock=time.monotonic):
        self.cap, self.rate, self._clock = cap, rate, clock
        self.window = float(cap)
        self.in_flight = 0
        self._cond = threading.Condition()
        self._halved_at = -HOLD_S
        self._next_start = 0.0  # the rate cap's: when the next request may start
        self.throttled = 0  # answers that said to slow down
        self.retries = 0  # tries made again, for any reason
        self.lowest = self.window  # the smallest window since made

    def call(self, request, *, deadline_s: float, sleep=time.sleep):
        """`request()` once it may start, made again after a throttling or passing failure until
        `deadline_s` from now; its result, or the last failure raised."""
        until = self._clock() + deadline_s
        backoff = BACKOFF_S[0]
        while True:
            self._enter()
            try:
                result = request()
            except BaseException as exc:
                kind = kind_of(exc)
                self._leave(throttled=kind == "throttled")
                if kind == "final" or self._clock() >= until:
                    raise
                wait = min(random.uniform(0, backoff), max(until - self._clock(), 0.0))
                backoff = min(backoff * 2, BACKOFF_S[1])
                with self._cond:
                    self.retries += 1
                sleep(wait)
                continue
            self._leave(throttled=False)
            return result

    def _enter(self) -> None:
        with self._cond:
            while self.in_flight >= max(int(self.window), 1):
                self._cond.wait(0.05)
            self.in_flight += 1
            start = self._next_start
            if self.rate:
                self._next_start = max(start, self._clock()) + 1.0 / self.rate
        if self.rate and start > self._clock():
            time.sleep(start - self._clock())

    def _leave(self, *, throttled: bool) -> None:
        with self._cond:
            now = self._clock()
            if throttled:
                self.throttled += 1
                if now - self._halved_at >= HOLD_S:  # half of what was in flight: a window above it would bind nothing
                    self._halved_at = now
                    self.window = max(min(self.window, self.in_flight) / 2, 1.0)
                    self.lowest = min(self.lowest, self.window)
            elif self.window < self.cap:
                self.window = min(self.window + 1.0 / self.window, float(self.cap))  # one more a window's worth
            self.in_flight -= 1
            self._cond.notify_all()

    def report(self) -> dict:
        with self._cond:
            return {"window": self.window, "lowest": self.lowest, "cap": self.cap, "throttled": self.throttled,
                    "retries": self.retries}


def kind_of(exc: BaseException) -> str:
    """"throttled", "final" (not found, refused credentials, a bad request, our own errors) or
    "passing" (refused or reset connections, timeouts, other 5xx): what a try again can mend."""
    if isinstance(exc, (ConfigError, IntegrityError, KeyboardInterrupt, SystemExit, FileNotFoundError)) or \
            "NotFound" in type(exc).__name__ or "PermissionDenied" in type(exc).__name__ or \
            "Unauthenticated" in type(exc).__name__:
        return "final"
    text = str(exc).split("Debug source")[0]
    status = _STATUS.search(text)
    status = int(status.group(1)) if status else None
    if status in THROTTLED_STATUS or any(s in text for s in THROTTLED):
        return "throttled"
    if status is not None and 400 <= status < 500 and status != 408:  # tried again, it would come back the same
        return "final"
    return "passing"


_pace: Pace | None = None
_pid: int | None = None
_lock = threading.Lock()


def pace() -> Pace:
    """This process's pace (one for every store it reads: a node's requests share its link)."""
    global _pace, _pid
    with _lock:
        if _pace is None or _pid != os.getpid():
            cap = setting("MMPACK_REMOTE_REQUESTS", CAP, "the requests a process may have in flight, e.g. 64")
            _pace = Pace(max(int(cap), 1), setting("MMPACK_REMOTE_RATE", None, "the requests a process may start "
                                                   "a second, e.g. 1000"))
            _pid = os.getpid()
        return _pace
