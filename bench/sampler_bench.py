"""`bench sampler`: opening a loader's order over N samples and taking its first batch (time,
peak RSS above what the imports take), per-position orders and a Mixture's stream against the
full permutation mmpack 0.3 made, each in a fresh process so that peak memory is its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

FULL_BYTES_PER_SAMPLE = 16  # the 0.3 order: an int64 permutation plus its int64 copy


def open_per_position(n: int, batch: int) -> None:
    """What Loader / StatefulDataLoader do now: the plan, len(), the first batch's ids, a state."""
    from loaders.order.sampler import Epochs

    plan = Epochs(n, batch, shuffle=True, order=None, seed=0, drop_last=False, rank=0, world_size=8)
    plan.num_batches()
    plan.batch_ids(plan.start(), 0)
    again = Epochs(n, batch, shuffle=True, order=None, seed=0, drop_last=False, rank=0, world_size=8)
    again.load_state_dict({**plan.state_dict(), "cursor": n // 2})
    again.batch_ids(again.start(), 0)


def open_mixture(n: int, batch: int) -> None:
    """A Mixture's stream over three sources of n / 3 samples (5:3:2), the same steps."""
    from loaders.order.blend import Blend
    from loaders.order.sampler import Epochs

    blend = Blend([max(1, n // 3)] * 3, [5, 3, 2], num_samples=n)
    kw = dict(shuffle=True, order=None, seed=0, drop_last=False, rank=0, world_size=8, stream=blend)
    plan = Epochs(n, batch, **kw)
    plan.num_batches()
    plan.batch_ids(plan.start(), 0)
    again = Epochs(n, batch, **kw)
    again.load_state_dict({**plan.state_dict(), "epoch": 7, "cursor": n // 2})
    again.batch_ids(again.start(), 0)


class SkewedLengths:
    """A length for every sample id without an array of N: log-logistic (close to the lognormal of
    speech durations and documents), median 128, 1 to 65,536; a class, as a dataset's lengths are."""

    def __call__(self, ids):
        import numpy as np

        from loaders.order.orders import mix

        u = (mix(np.asarray(ids, np.uint64) + np.uint64(0x5EED)) >> np.uint64(11)).astype(np.float64) / 2.0**53
        z = np.log(np.clip(u, 1e-12, 1 - 1e-12) / np.clip(1 - u, 1e-12, 1)) * 0.55  # a logistic ~ a normal of sd 1
        return np.clip(np.exp(np.log(128) + z), 1, 65536).astype(np.int64)

    def shortest(self) -> int:
        return 1


def open_length_plan(n: int, batch: int, max_tokens: int | None = None) -> dict:
    """What a Loader with bucket_by="length" (or max_tokens) does at iter(): the plan and the
    first batch's ids (its windows counted as reached: no pass over the N lengths). Returned,
    timed apart: `count_seconds`, the epoch's batch count (what len() asks, a pass over every
    window), and `resume_seconds`, a state saved half-way through the epoch loaded into a fresh
    plan and its first batch (the windows before the cursor counted, in threads)."""
    import time

    from loaders.order.lengths import Budget
    from loaders.order.planned import DatasetOrder, LengthEpochs

    budget = Budget(max_tokens=max_tokens) if max_tokens else Budget(batch_size=batch)

    def plan() -> LengthEpochs:
        return LengthEpochs(n, budget, positions_of=DatasetOrder(n, 8192), lengths=SkewedLengths(), bucket_by="length",
                            column="tokens", shuffle=True, order=None, seed=0, drop_last=False, rank=0, world_size=8)

    first = plan()
    p = first.start()
    first.batch_ids(p, 0)
    started = time.perf_counter()
    total = first.plan(p.epoch, p.slices).total
    counted = time.perf_counter()
    again = plan()
    again.load_state_dict({**first.state_dict(), "cursor": total // 2 // 8 * 8})
    again.batch_ids(again.start(), 0)
    return {"count_seconds": counted - started, "resume_seconds": time.perf_counter() - counted}


def open_full_permutation(n: int, batch: int) -> None:
    """What mmpack 0.3 did: len() and the first batch each computed the epoch's permutation."""
    import numpy as np

    for _ in range(2):
        order = np.random.default_rng([0, 0]).permutation(n).astype(np.int64)
        order[0:batch * 8:8]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024**2


def _peak_mb() -> float:
    """This process's peak RSS (VmHWM: unlike getrusage's maxrss it does not carry the size of
    the parent this process was forked from)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _child(kind: str, n: int, batch: int) -> None:
    import loaders.order.planned  # noqa: F401  imports (torch) before the clock and the memory baseline

    base = _rss_mb()
    start = time.perf_counter()
    opens = {"per-position": open_per_position, "mixture": open_mixture, "full": open_full_permutation,
             "length": open_length_plan, "max_tokens": lambda n, b: open_length_plan(n, b, MAX_TOKENS)}
    apart = opens[kind](n, batch) or {}
    seconds = time.perf_counter() - start
    # the plan's first batch; apart from it, what the plans time of their own (a count, a resume)
    row = {"seconds": seconds - sum(apart.values()), **apart, "peak_rss_mb": _peak_mb() - base}
    print(json.dumps(row))


MAX_TOKENS = 65536  # the max_tokens plan's budget: about 300 samples of the median length
PLANS = ("length plan (bucket_by)", "max_tokens plan")


def bench_sampler(args) -> dict:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rows = []
    runs = [(n, kind) for n in args.samples for kind in ("per-position", "mixture of 3 sources", "full permutation (0.3)")]
    runs += [(n, kind) for n in args.length_samples for kind in PLANS]
    for n, kind in runs:
        row = {"system": kind, "num_samples": n}
        if kind.startswith("full") and n * FULL_BYTES_PER_SAMPLE > 0.6 * ram:
            row["skipped"] = f"needs {n * FULL_BYTES_PER_SAMPLE / 1024**3:,.0f} GiB of RAM"
        else:
            code = f"from bench.sampler_bench import _child; _child({_kind(kind)!r}, {n}, {args.batch_size})"
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if out.returncode:
                row["error"] = out.stderr.strip().splitlines()[-1][:160] if out.stderr.strip() else f"exit {out.returncode}"
            else:
                row.update(json.loads(out.stdout))
        rows.append(row)
        print(f"  measured {kind} over {n:,}: {row.get('skipped') or row.get('error') or row['seconds']}",
              file=sys.stderr, flush=True)
    return {"command": "bench sampler", "batch_size": args.batch_size, "world_size": 8, "max_tokens": MAX_TOKENS,
            "results": rows}


def _kind(system: str) -> str:
    return {"length plan (bucket_by)": "length", "max_tokens plan": "max_tokens"}.get(system, system.split()[0])
