"""Requests at a rate the store accepts: every request of this process goes through `call`,
which tries it again (jittered, until the deadline) and paces them all.

S3 answers 503 SlowDown while it scales a prefix (about 5,500 GETs/s each): it serves a rate,
whatever the requests in flight, and answers the rest 503. A job of many ranks whose requests
only back off each on its own keeps the store busy with retries. So this process keeps a rate of
request starts: none at first; at a throttling answer, half the rate it was starting requests at
(once per HOLD_S, however many of its requests meet the same burst); after each STEP_S without
one, GROWTH times more, RECOVERY times once QUIET_S passed without one, and none again once it
no longer binds. The growth is counted in time, not in requests started: at a rate of one a
second a count of starts grew it once a second. And a request waiting for its start looks at the
rate again as it waits: starts granted at the floor, each a second after the last, held every
request back for as many seconds after a storm of 503s had ended (60% of the answers for 6 s
left the rate at 90% of before only 4.75 s after it; `bench remote --throttle`).
MMPACK_REMOTE_RATE caps the rate (a job that shares a prefix among N processes: its rate over N
each), MMPACK_REMOTE_REQUESTS the requests in flight (CAP). A throttled or failed request waits a
random time up to a doubling backoff (full jitter, so the ranks that met one burst do not come
back together; at most THROTTLED_WAIT_S for a throttled one, whose rate the pace slows already)
and is made again by the same thread: a download in progress is never duplicated (the cache's
lock holds other processes off the file meanwhile). The store client makes one try a call
(`client.retry_config`): only here are tries counted. An answer that the keys expired is tried
again where the keys are read again before each try (`credentials`), and final where they are
not (keys in the environment never change within a process).
"""

from __future__ import annotations

import collections
import os
import random
import re
import threading
import time

from packer.errors import ConfigError, IntegrityError

CAP = 64  # requests in flight at most, per process
HOLD_S = 0.5  # one halving per burst: the answers of requests already in flight come within it
STEP_S = 0.25  # the rate grows after each such time without a throttling answer: by GROWTH,
GROWTH = 1.25
QUIET_S = 1.0  # and by RECOVERY once this long has passed without one (the throttling is over)
RECOVERY = 2.0
TICK_S = 0.05  # a request waiting for its start looks again this often: a rate grown meanwhile counts at once
BACKOFF_S = (0.1, 5.0)  # the first retry's most wait, and the longest
THROTTLED_WAIT_S = 1.0  # the longest wait before a throttled request is tried again: the rate slows it, not this
# what a store says when it throttles: S3 503 SlowDown, Azure 503 ServerBusy, GCS and others 429
THROTTLED_STATUS = (429, 503)
THROTTLED = ("<Code>SlowDown<", "<Code>ServerBusy<", "<Code>TooManyRequests<", "<Code>RequestLimitExceeded<")
# what S3 (and STS) say of keys past their end: keys read again (a profile a helper rewrites) mend it
EXPIRED = ("<Code>ExpiredToken<", "<Code>ExpiredTokenException<", "<Code>RequestExpired<",
           "<Code>TokenRefreshRequired<")
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
    """The rate of request starts (see the module), and what it met, for a report."""

    def __init__(self, cap: int = CAP, rate: float | None = None, clock=time.monotonic):
        self.cap, self.ceiling, self._clock = cap, rate, clock
        self.rate = rate  # starts a second allowed now; None: as many as come
        self.in_flight = 0
        self._cond = threading.Condition()
        self._starts: collections.deque = collections.deque()  # the last second's start times
        self._halved_at = self._throttled_at = -QUIET_S  # the last halving, the last throttling answer
        self._grown_at = 0.0  # the end of the last STEP_S the rate grew for
        # request starts in turns: turn n starts at _at + (n - _turn) / rate (the schedule is made
        # again whenever the rate changes, so the turns granted at a low rate never hold the
        # requests back once it grew)
        self._issued = self._started = self._turn = 0
        self._at = self._last = 0.0
        self.throttled = 0  # answers that said to slow down
        self.retries = 0  # tries made again, for any reason
        self.lowest = rate  # the lowest rate allowed since made (None: never limited)

    def call(self, request, *, deadline_s: float, sleep=time.sleep, renewable: bool = True):
        """`request()` once it may start, made again after a throttling or passing failure until
        `deadline_s` from now; its result, or the last failure raised. `renewable`: the keys are
        read again before a try (a profile's file), so an answer that they expired is tried again."""
        until = self._clock() + deadline_s
        backoff = BACKOFF_S[0]
        while True:
            self._enter(sleep)
            try:
                result = request()
            except BaseException as exc:
                kind = kind_of(exc)
                self._leave(throttled=kind == "throttled")
                if kind == "final" or (kind == "expired" and not renewable) or self._clock() >= until:
                    raise
                most = min(backoff, THROTTLED_WAIT_S) if kind == "throttled" else backoff
                wait = min(random.uniform(0, most), max(until - self._clock(), 0.0))
                backoff = min(backoff * 2, BACKOFF_S[1])
                with self._cond:
                    self.retries += 1
                sleep(wait)
                continue
            self._leave(throttled=False)
            return result

    def _enter(self, sleep) -> None:
        """A turn taken, then waited for: looked at again each TICK_S, so a rate that grew (or
        stopped binding) meanwhile starts it sooner."""
        with self._cond:
            while self.in_flight >= self.cap:
                self._cond.wait(0.05)
            self.in_flight += 1
            turn, self._issued = self._issued, self._issued + 1
        while True:
            with self._cond:
                now = self._clock()
                self._grow(now)
                start = now if self.rate is None else self._at + (turn - self._turn) / self.rate
                if start <= now:
                    self._started += 1
                    self._last = max(self._last, start)
                    self._starts.append(now)
                    while self._starts and self._starts[0] < now - 1.0:
                        self._starts.popleft()
                    return
            sleep(min(start - now, TICK_S))

    def _schedule(self, now: float) -> None:
        """The turns not started yet, spaced at the rate from the last start (none sooner than
        now). Under the lock, whenever the rate changes."""
        self._turn = self._started
        self._at = max(self._last + 1.0 / self.rate, now) if self.rate else now

    def _grow(self, now: float) -> None:
        """For each STEP_S without a throttling answer, GROWTH more (RECOVERY more once QUIET_S
        passed without one); none (or the ceiling) once it is twice what this process starts a
        second: it no longer binds. Under the lock."""
        if self.rate is None or self.rate == self.ceiling:
            return
        at = max(self._grown_at, self._throttled_at)
        if now - at < STEP_S:
            return
        while self._starts and self._starts[0] < now - 1.0:  # (after a pause: starts of long ago are not a rate)
            self._starts.popleft()
        while now - at >= STEP_S and self.rate is not None:
            at += STEP_S
            self.rate *= RECOVERY if at - self._throttled_at >= QUIET_S else GROWTH
            if self.rate >= 2 * max(len(self._starts), 1) or (self.ceiling and self.rate >= self.ceiling):
                self.rate = self.ceiling
                break
        self._grown_at = at
        self._schedule(now)

    def _leave(self, *, throttled: bool) -> None:
        with self._cond:
            self.in_flight -= 1
            now = self._clock()
            if throttled:
                self.throttled += 1
                self._throttled_at = now
                if now - self._halved_at >= HOLD_S:  # half the rate it was starting requests at
                    self._halved_at = now
                    started = len([t for t in self._starts if t >= now - 1.0])
                    self.rate = max(min(self.rate or float("inf"), started) / 2, 1.0)
                    self.lowest = self.rate if self.lowest is None else min(self.lowest, self.rate)
                    self._schedule(now)
            self._cond.notify_all()

    def report(self) -> dict:
        with self._cond:
            return {"rate": self.rate, "lowest": self.lowest, "cap": self.cap, "ceiling": self.ceiling,
                    "throttled": self.throttled, "retries": self.retries}


def kind_of(exc: BaseException) -> str:
    """"throttled", "expired" (keys past their end: keys read again mend it), "final" (not found,
    refused credentials, a bad request, our own errors) or "passing" (refused or reset
    connections, a body cut off, timeouts, other 5xx): what a try again can mend."""
    if isinstance(exc, (ConfigError, IntegrityError, KeyboardInterrupt, SystemExit, FileNotFoundError)):
        return "final"
    text = str(exc).split("Debug source")[0]
    if any(s in text for s in EXPIRED):  # (S3 says it with a 400 or a 403, whichever class the client gives it)
        return "expired"
    if "NotFound" in type(exc).__name__ or "PermissionDenied" in type(exc).__name__ or \
            "Unauthenticated" in type(exc).__name__:
        return "final"
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
