"""`bench remote --throttle`: requests through a store that throttles for a while, as S3 does
while it scales a prefix, with our pacing (`packer.remote.pace`) and without it (the client's
own retries, what mmpack did before).

A proxy in front of the loopback S3 server passes every request, but for `burst_s` seconds it
takes only `burst_share` of the rate it saw before and answers the rest 503 SlowDown. `threads`
threads GET small objects as fast as they are answered, for `seconds` in all. Per way, in 0.25 s
bins: the requests answered well a second; then the rate before the burst, the 503s the store
had to answer (its load while it scales), and the seconds after the burst until the rate is
back at 90% of the rate before it.

Then a storm, paced: for `storm_s` seconds the proxy answers `storm_share` of the requests 503
SlowDown whatever their rate, then none. A pace that halved at every throttling answer and grew
1.25x a quiet quarter second sank to its floor (a request a second) within such a storm, and the
starts it had granted at that rate held the requests back long after it (issue 61): the row
says how soon the rate is back.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import statistics
import threading
import time

BIN_S = 0.25
SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")


class Throttle:
    """The proxy: `url`; `start_burst(rate)` takes at most `rate` requests a second for
    `burst_s` from now; `ok` and `refused` are the times of the answers it passed and refused."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.lock = threading.Lock()
        self.ok: list[float] = []
        self.refused: list[float] = []
        self.until, self.rate, self.next_free = 0.0, None, 0.0
        self.share, self._dice = 0.0, random.Random(61)
        threading.Thread(target=self._accept, daemon=True).start()

    def start_burst(self, rate: float, seconds: float) -> None:
        with self.lock:
            self.rate, self.until, self.next_free = rate, time.monotonic() + seconds, time.monotonic()

    def start_storm(self, share: float, seconds: float) -> None:
        """For `seconds` from now, `share` of the requests refused, whatever their rate."""
        with self.lock:
            self.rate, self.share, self.until = None, share, time.monotonic() + seconds

    def _admit(self) -> bool:
        now = time.monotonic()
        with self.lock:
            if now >= self.until:
                return True
            if self.rate is None:  # a storm
                if self._dice.random() >= self.share:
                    return True
                self.refused.append(now)
                return False
            if self.next_free <= now:  # one request each 1/rate s gets through, as a prefix being scaled serves some
                self.next_free = max(self.next_free, now - 1.0 / self.rate) + 1.0 / self.rate
                return True
            self.refused.append(now)
            return False

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)
        reader, answers = client.makefile("rb"), upstream.makefile("rb")
        try:
            while True:
                head = _head(reader)
                if head is None:
                    return
                body = reader.read(_length(head)) if _length(head) else b""
                if not self._admit():
                    client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: "
                                   + str(len(SLOWDOWN)).encode() + b"\r\n\r\n" + SLOWDOWN)
                    continue
                upstream.sendall(head + body)
                answer = _head(answers)
                if answer is None:
                    return
                client.sendall(answer + answers.read(_length(answer)))
                with self.lock:
                    self.ok.append(time.monotonic())
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.close()

    def close(self) -> None:
        self.server.close()


def _head(f) -> bytes | None:
    lines = []
    while True:
        line = f.readline()
        if not line:
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def _length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def _way(paced: bool, endpoint: str, url: str, keys: list[str], threads: int, seconds: float, burst_at: float,
         burst_s: float, burst_share: float, storm: bool = False) -> dict:
    """One way's run; `storm`: `burst_share` of the requests refused whatever their rate (else
    a burst: the store takes `burst_share` of the rate before it)."""
    from datetime import timedelta

    import obstore as obs

    from packer.remote import client, pace
    from packer.remote.url import Remote

    remote = Remote(url)
    throttle = Throttle(endpoint)
    saved, endpoint_was = client.retry_config, os.environ.get("AWS_ENDPOINT_URL")
    try:
        if not paced:  # the client's own retries, as before: every 5xx tried again inside obstore
            client.retry_config = lambda: {"max_retries": 1000, "retry_timeout": timedelta(seconds=120),
                                           "backoff": {"init_backoff": timedelta(milliseconds=100),
                                                       "max_backoff": timedelta(seconds=5), "base": 2}}
        pace._pace = pace.Pace()
        os.environ["AWS_ENDPOINT_URL"] = throttle.url
        store = client.store(remote)
        start = time.monotonic()
        stop = start + seconds

        def work(k: int) -> None:
            i = k
            while time.monotonic() < stop:
                key = remote.key(keys[i % len(keys)])
                got = client.get(obs, store, key) if paced else obs.get(store, key)
                bytes(got.bytes())
                i += threads
        pool = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(threads)]
        for t in pool:
            t.start()
        time.sleep(burst_at)
        before = _rate(throttle.ok, start + 1.0, start + burst_at)  # (the first second warms up connections)
        if storm:
            throttle.start_storm(burst_share, burst_s)
        else:
            throttle.start_burst(before * burst_share, burst_s)
        for t in pool:
            t.join()
        return _summary(throttle, start, seconds, burst_at, burst_s, before, pace._pace.report() if paced else None)
    finally:
        client.retry_config = saved
        if endpoint_was is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = endpoint_was
        throttle.close()


def _rate(times: list[float], a: float, b: float) -> float:
    return sum(a <= t < b for t in times) / (b - a)


def _summary(throttle: Throttle, start: float, seconds: float, burst_at: float, burst_s: float, before: float,
             report) -> dict:
    bins = [_rate(throttle.ok, start + k * BIN_S, start + (k + 1) * BIN_S) for k in range(int(seconds / BIN_S))]
    end = burst_at + burst_s
    back = next((k * BIN_S - end for k in range(int(end / BIN_S), len(bins)) if bins[k] >= 0.9 * before), None)
    return {"rate_before": before, "refused_503": len(throttle.refused),
            "rate_in_burst": _rate(throttle.ok, start + burst_at, start + end),
            "recovered_after_s": back, "bins_per_s": bins, "pace": report,
            "rate_after": statistics.median(bins[int((end + 3.0) / BIN_S):]) if end + 3.0 < seconds else None}


def bench_throttle(endpoint: str, url: str, keys: list[str], threads: int = 16, seconds: float = 14.0,
                   burst_at: float = 4.0, burst_s: float = 2.0, burst_share: float = 0.1, storm_s: float | None = None,
                   storm_share: float = 0.6) -> dict:
    """Both ways, one after the other, on the same server and objects, then (`storm_s`) the
    storm, paced (see the module)."""
    ways = {name: _way(paced, endpoint, url, keys, threads, seconds, burst_at, burst_s, burst_share)
            for name, paced in (("paced", True), ("client retries", False))}
    out = {"threads": threads, "seconds": seconds, "burst_at_s": burst_at, "burst_s": burst_s,
           "burst_share": burst_share, "bin_s": BIN_S, "ways": ways}
    if storm_s:  # as long after the storm as after the burst
        out["storm"] = {"share": storm_share, "seconds": storm_s,
                        **_way(True, endpoint, url, keys, threads, seconds + storm_s - burst_s, burst_at, storm_s,
                               storm_share, storm=True)}
    return out


def throttle_table(r: dict) -> list[str]:
    rows = [f"{r['threads']} threads GET small objects; from {r['burst_at_s']:g} s the store takes "
            f"{r['burst_share']:.0%} of the rate for {r['burst_s']:g} s and answers the rest 503 SlowDown",
            f"{'way':>15} {'before/s':>9} {'in burst/s':>10} {'503s':>7} {'back in s':>9} {'after/s':>8}"]
    for name, w in r["ways"].items():
        back = "never" if w["recovered_after_s"] is None else f"{w['recovered_after_s']:.2f}"
        after = "-" if w["rate_after"] is None else f"{w['rate_after']:,.0f}"
        rows.append(f"{name:>15} {w['rate_before']:>9,.0f} {w['rate_in_burst']:>10,.0f} {w['refused_503']:>7,} "
                    f"{back:>9} {after:>8}")
    storm = r.get("storm")
    if storm:
        back = "never" if storm["recovered_after_s"] is None else f"{storm['recovered_after_s']:.2f}"
        after = "-" if storm["rate_after"] is None else f"{storm['rate_after']:,.0f}"
        rows += [f"then a storm: from {r['burst_at_s']:g} s the store answers {storm['share']:.0%} of the requests "
                 f"503 SlowDown for {storm['seconds']:g} s, whatever their rate",
                 f"{'paced, storm':>15} {storm['rate_before']:>9,.0f} {storm['rate_in_burst']:>10,.0f} "
                 f"{storm['refused_503']:>7,} {back:>9} {after:>8}"]
    return rows


def plot_throttle(plt, r: dict, path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, w in r["ways"].items():
        ax.plot([k * r["bin_s"] for k in range(len(w["bins_per_s"]))], w["bins_per_s"], label=name)
    storm = r.get("storm")
    if storm:
        ax.plot([k * r["bin_s"] for k in range(len(storm["bins_per_s"]))], storm["bins_per_s"], label="paced, storm")
        ax.axvspan(r["burst_at_s"] + r["burst_s"], r["burst_at_s"] + storm["seconds"], color="0.93",
                   label=f"storm ({storm['share']:.0%} refused) goes on")
    ax.axvspan(r["burst_at_s"], r["burst_at_s"] + r["burst_s"], color="0.85", label="store throttling")
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests answered well / s")
    ax.set_title("A store that throttles for a while: requests answered, paced and not")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
