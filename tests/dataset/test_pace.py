"""Requests paced by what the store answers (`packer.remote.pace`): a throttling answer halves
the requests in flight, answers that come back well grow them back to the cap, every failure
that a try again can mend is tried again with a jittered wait until the deadline, and a burst
of S3's 503 SlowDown through a real server leaves an epoch whole."""

from __future__ import annotations

import threading
import time

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


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_burst_halves_the_requests_in_flight_once_and_answers_grow_them_back_to_the_cap():
    clock = Clock()
    pace = Pace(cap=16, clock=clock)
    pace.in_flight = 12  # twelve requests in flight meet one burst: one halving, of the twelve
    for _ in range(12):
        pace.in_flight += 1
        pace._leave(throttled=True)
    assert pace.window == 6.5 and pace.throttled == 12
    clock.now += pacing.HOLD_S  # the burst goes on: halved again, once
    pace._leave(throttled=True)
    pace.in_flight = 0
    assert pace.window == 3.25 and pace.lowest == 3.25
    answers = 0
    while pace.window < pace.cap:  # one more for each window's worth of answers that came back well
        pace.in_flight += 1
        pace._leave(throttled=False)
        answers += 1
    assert answers == pytest.approx(sum(range(4, 16)), abs=16)  # back at the cap within ~120 answers
    assert pace.window == 16


def test_tries_wait_a_jittered_doubling_backoff_until_the_deadline_and_final_answers_are_not_tried_again():
    clock = Clock()
    waits = []

    def sleep(s):
        waits.append(s)
        clock.sleep(s)
    pace = Pace(cap=4, clock=clock)
    with pytest.raises(Answer):
        pace.call(lambda: (_ for _ in ()).throw(Answer("503 Slow Down")), deadline_s=60, sleep=sleep)
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
    assert pace.call(flaky, deadline_s=60, sleep=lambda s: None) == "bytes"


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
    assert (got.cap, got.window, got.rate) == (8, 8.0, 500.0)
    monkeypatch.setattr(pacing, "_pace", None)
    monkeypatch.setenv("MMPACK_REMOTE_RATE", "fast")
    with pytest.raises(ConfigError, match="MMPACK_REMOTE_RATE"):
        pacing.pace()
