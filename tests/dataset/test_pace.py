"""Requests paced by what the store answers (`packer.remote.pace`): a throttling answer halves
the rate of request starts, quiet grows it back until it no longer binds, every failure
that a try again can mend is tried again with a jittered wait until the deadline, and a burst
of S3's 503 SlowDown through a real server leaves an epoch whole."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from packer.errors import ConfigError
from packer.remote import pace as pacing
from packer.remote.pace import Pace, kind_of


class Answer(Exception):
    """What obstore raises: the status in its message, after the URL."""

    def __init__(self, status: str, path: str = "bucket/ds/shard-00404/image.npy", body: str = ""):
        super().__init__(f"Generic S3 error: Error performing GET http://127.0.0.1:9/{path} in 3ms - Server "
                         f"returned non-2xx status code: {status}: {body}\n\nDebug source:\nGeneric {{ status: 404 }}")


def test_what_a_store_says_is_read_from_its_status_not_from_the_url():
    assert kind_of(Answer("503 Slow Down", body="<Error><Code>SlowDown</Code></Error>")) == "throttled"
    assert kind_of(Answer("503 Service Unavailable")) == "throttled"  # (its path holds 404)
    assert kind_of(Answer("429 Too Many Requests")) == "throttled"
    assert kind_of(Answer("404 Not Found", path="b/shard-00503/x.npy")) == "final"
    assert kind_of(Answer("403 Forbidden", path="b/shard-00503/x.npy")) == "final"
    assert kind_of(Answer("500 Internal Server Error")) == "passing"
    assert kind_of(Answer("408 Request Timeout")) == "passing"
    assert kind_of(Exception("Generic S3 error: HTTP error: error sending request")) == "passing"
    assert kind_of(FileNotFoundError("x")) == "final" and kind_of(ConfigError("x")) == "final"
    for code in ("ExpiredToken", "RequestExpired", "TokenRefreshRequired"):  # keys read again mend it, 400 or 403
        assert kind_of(Answer("400 Bad Request", body=f"<Error><Code>{code}</Code></Error>")) == "expired"
    assert kind_of(Answer("400 Bad Request", body="<Error><Code>InvalidArgument</Code></Error>")) == "final"


def test_an_answer_that_the_keys_expired_is_tried_again_only_where_they_are_read_again():
    clock, tries = Clock(), []

    def expired():
        tries.append(clock.now)
        if len(tries) < 3:
            raise Answer("400 Bad Request", body="<Error><Code>ExpiredToken</Code></Error>")
        return "bytes"
    assert Pace(clock=clock).call(expired, deadline_s=60, sleep=clock.sleep) == "bytes" and len(tries) == 3
    tries.clear()
    with pytest.raises(Answer):
        Pace(clock=clock).call(expired, deadline_s=60, sleep=clock.sleep, renewable=False)
    assert len(tries) == 1


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_burst_halves_the_rate_once_and_quiet_grows_it_back_within_three_seconds():
    clock = Clock()
    pace = Pace(cap=64, clock=clock)
    for _ in range(400):  # 400 starts a second, as many as come (no rate yet)
        pace._enter(clock.sleep)
        pace._leave(throttled=False)
        clock.now += 0.0025
    assert pace.rate is None
    for _ in range(12):  # twelve answers of one burst: one halving, of the rate it was starting at
        pace.in_flight += 1
        pace._leave(throttled=True)
    assert pace.rate == 200 and pace.throttled == 12
    clock.now += pacing.HOLD_S  # the burst goes on: halved again, once
    pace.in_flight += 1
    pace._leave(throttled=True)
    assert pace.rate == 100 and pace.lowest == 100
    started = []
    for _ in range(20):  # requests keep coming: the rate spaces their starts, 1/100 s apart
        pace._enter(clock.sleep)
        started.append(clock.now)
        pace._leave(throttled=False)
    assert started[-1] - started[0] == pytest.approx(19 / 100)
    end = clock.now  # the burst is over: quiet grows the rate until it no longer binds
    while pace.rate is not None:
        pace._enter(clock.sleep)
        pace._leave(throttled=False)
    assert clock.now - end < 3.0


def test_a_cap_on_the_rate_is_kept_and_grown_back_to():
    clock = Clock()
    pace = Pace(rate=50.0, clock=clock)
    waits = []
    for _ in range(51):
        pace._enter(lambda s: waits.append(s) or clock.sleep(s))
        pace._leave(throttled=False)
    assert clock.now == pytest.approx(1.0, abs=1e-6)  # 51 starts, 1/50 s apart
    pace.in_flight += 1
    pace._leave(throttled=True)
    assert pace.rate == 25.0
    while pace.rate != 50.0:
        pace._enter(clock.sleep)
        pace._leave(throttled=False)
    assert pace.rate == pace.ceiling == 50.0


def test_tries_wait_a_jittered_doubling_backoff_until_the_deadline_and_final_answers_are_not_tried_again():
    clock = Clock()
    waits = []

    def sleep(s):
        waits.append(s)
        clock.sleep(s)
    pace = Pace(cap=4, clock=clock)
    with pytest.raises(Answer):  # (a 500: the rate stays as it is, every wait is the backoff's)
        pace.call(lambda: (_ for _ in ()).throw(Answer("500 Internal Server Error")), deadline_s=60, sleep=sleep)
    assert clock.now >= 60 and max(waits) <= pacing.BACKOFF_S[1]
    firsts = waits[:5]
    assert all(w <= pacing.BACKOFF_S[0] * 2 ** k for k, w in enumerate(firsts))
    assert len(set(waits)) == len(waits)  # jittered: no two ranks that met one burst come back together
    tries = []
    with pytest.raises(Answer):
        pace.call(lambda: tries.append(1) or (_ for _ in ()).throw(Answer("404 Not Found")), deadline_s=60)
    assert tries == [1]
    outcomes = iter([Answer("500 Internal Server Error"), Answer("503 Slow Down"), None])

    def flaky():
        got = next(outcomes)
        if got is not None:
            raise got
        return "bytes"
    assert pace.call(flaky, deadline_s=60, sleep=clock.sleep) == "bytes"


def test_no_more_requests_are_in_flight_than_the_window():
    pace = Pace(cap=3)
    most, now, lock = [0], [0], threading.Lock()

    def request():
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.02)
        with lock:
            now[0] -= 1
    threads = [threading.Thread(target=pace.call, args=(request,), kwargs={"deadline_s": 10}) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 3 and pace.in_flight == 0


def test_the_cap_and_the_rate_are_read_from_the_environment(monkeypatch):
    monkeypatch.setattr(pacing, "_pace", None)
    monkeypatch.setenv("MMPACK_REMOTE_REQUESTS", "8")
    monkeypatch.setenv("MMPACK_REMOTE_RATE", "500")
    got = pacing.pace()
    assert (got.cap, got.ceiling, got.rate) == (8, 500.0, 500.0)
    monkeypatch.setattr(pacing, "_pace", None)
    monkeypatch.setenv("MMPACK_REMOTE_RATE", "fast")
    with pytest.raises(ConfigError, match="MMPACK_REMOTE_RATE"):
        pacing.pace()



class SimulatedTime:
    """A clock for threads: `sleep` blocks a thread until the simulated time reaches its end,
    and time moves (to the next end) only when every thread of the simulation sleeps, so a run
    takes no wall-clock time to speak of and does not depend on the machine's load."""

    def __init__(self, threads: int):
        self.now, self.threads, self._cond = 0.0, threads, threading.Condition()
        self._ends: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        with self._cond:
            end = self.now + max(seconds, 0.0)
            self._ends.append(end)
            if len(self._ends) == self.threads:  # the last one awake: time moves on
                self.now = min(self._ends)
                self._cond.notify_all()
            while self.now < end:
                self._cond.wait()
            self._ends.remove(end)

    def done(self) -> None:
        with self._cond:
            self.threads -= 1
            if self._ends and len(self._ends) == self.threads:
                self.now = min(self._ends)
                self._cond.notify_all()


def _storm(*, threads: int, share: float, start_s: float, storm_s: float, end_s: float) -> tuple[list, Pace]:
    """`threads` threads whose requests take 10 ms each, one after the other, through a
    pace, against a store that answers `share` of them 503 SlowDown from `start_s` for `storm_s`
    seconds (whatever their rate), then none. The simulated times of the answers that came
    well, and the pace."""
    clock = SimulatedTime(threads)
    pace = Pace(cap=64, clock=clock)
    dice, good = random.Random(61), []

    def request():
        clock.sleep(0.01)
        if start_s <= clock.now < start_s + storm_s and dice.random() < share:
            raise Answer("503 Slow Down", body="<Error><Code>SlowDown</Code></Error>")
        good.append(clock.now)

    def reader():
        try:
            while clock.now < end_s:
                pace.call(request, deadline_s=1e9, sleep=clock.sleep)
        finally:
            clock.done()
    random.seed(61)  # (the backoff's jitter)
    pool = [threading.Thread(target=reader) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sorted(good), pace


def test_after_a_storm_of_slowdowns_the_rate_is_back_within_seconds_not_minutes():
    """60% of the answers 503 SlowDown for 10 s, then none (issue 61), to 16 threads. The rate
    fell to its floor, a request a second; it grew 1.25 times per request started, and the
    requests waiting had been granted starts a second apart, so they were held back for many
    seconds after the storm. Quiet grows it by time (twice as fast once a second passed without
    a throttling answer) and a waiting request looks at it again: back within 4 s."""
    good, pace = _storm(threads=16, share=0.6, start_s=2.0, storm_s=10.0, end_s=18.0)
    good = np.asarray(good)

    def rate(a: float, b: float) -> float:
        return float(((good >= a) & (good < b)).sum() / (b - a))
    before = rate(1.0, 2.0)
    assert before > 1_500  # (16 threads, 10 ms a request)
    assert rate(7.0, 12.0) < before / 20  # slowed in the storm
    back = next((t for t in np.arange(12.0, 17.5, 0.25) if rate(t, t + 0.5) >= 0.9 * before), None)
    assert back is not None and back - 12.0 <= 4.0, back
    assert pace.rate is None  # and it no longer binds
