"""`bench packer --map`: `packer.map` against LitData's `optimize` on the same function and
inputs: a voice model's features (log-mel frames and a pitch track, `bench.voice.features`,
torch ops) of real recordings, at 1 and 2 workers (`--workers-list`): samples a second, bytes
written, and whether what each wrote reads back equal to the function's output. LitData's
rows come where it is installed (bench/peers-requirements.txt's venv); elsewhere they say so.
Runs alternate (mmpack, LitData, mmpack, ...) so that a machine slowing down in the hour does
not favour either."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from . import sounds
from .loaders_bench import machine
from .measure import dir_bytes
from .voice import features


def clips(count: int) -> list[str]:
    """`count` real recordings (the ALSA voices and the freedesktop sounds, cycled)."""
    pool = [str(p) for p in sounds.speech() + sounds.effects()]
    return [pool[i % len(pool)] for i in range(count)]


def _mmpack(inputs: list[str], out: Path, workers: int) -> float:
    import packer

    started = time.perf_counter()
    packer.map(features, inputs, out, workers=workers, shard_size="64MB", chunk=16)
    return time.perf_counter() - started


def _litdata(inputs: list[str], out: Path, workers: int) -> float:
    import litdata

    started = time.perf_counter()
    litdata.optimize(fn=features, inputs=inputs, output_dir=str(out), chunk_bytes="64MB", num_workers=workers,
                     verbose=False, start_method="fork")
    return time.perf_counter() - started


def _check(inputs: list[str], out: Path, which: str) -> bool:
    """What was written reads back as the function's output, sample for sample, in order."""
    want = [features(p) for p in inputs[:8]]
    if which == "mmpack":
        from loaders import MMapDataset

        ds = MMapDataset(out)
        got = [ds[i] for i in range(len(want))]
        return all(np.array_equal(g["mel"].numpy(), w["mel"]) and np.array_equal(g["f0"].numpy(), w["f0"])
                   for g, w in zip(got, want))
    from litdata import StreamingDataset

    ds = StreamingDataset(str(out))
    return len(ds) == len(inputs) and all(np.array_equal(np.asarray(ds[i]["mel"]), w["mel"]) for i, w in
                                          enumerate(want))


def bench_map(args) -> dict:
    inputs = clips(args.clips)
    runners = {"mmpack": _mmpack}
    try:
        import litdata  # noqa: F401

        runners["LitData"] = _litdata
    except ImportError:
        pass
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmpack-map-bench-") as tmp:
        for workers in args.workers_list:
            times: dict[str, list[float]] = {name: [] for name in runners}
            sizes, equal = {}, {}
            for rnd in range(args.rounds):
                for name, run in runners.items():
                    out = Path(tmp) / f"{name}-{workers}-{rnd}"
                    times[name].append(run(inputs, out, workers))
                    sizes[name] = dir_bytes(out)
                    if rnd == 0:
                        equal[name] = _check(inputs, out, name.lower())
                    shutil.rmtree(out, ignore_errors=True)
            for name in runners:
                seconds = statistics.median(times[name])
                rows.append({"writer": name, "workers": workers, "samples": len(inputs), "seconds": seconds,
                             "samples_per_s": len(inputs) / seconds, "bytes": sizes[name],
                             "runs_s": times[name], "reads_back_equal": equal[name]})
    return {"machine": machine(), "clips": len(inputs), "rounds": args.rounds, "rows": rows,
            "litdata": "LitData" in runners}


def map_table(report: dict) -> str:
    lines = [f"{'writer':8} {'workers':>7} {'samples/s':>10} {'seconds':>8} {'MB written':>10} {'reads back':>10} "
             f"{'vs LitData':>10}"]
    lit = {r["workers"]: r for r in report["rows"] if r["writer"] == "LitData"}
    for r in report["rows"]:
        ratio = f"{r['samples_per_s'] / lit[r['workers']]['samples_per_s']:.2f}x" if r["workers"] in lit else "-"
        lines.append(f"{r['writer']:8} {r['workers']:>7} {r['samples_per_s']:>10,.1f} {r['seconds']:>8.2f} "
                     f"{r['bytes'] / 1e6:>10,.2f} {'yes' if r['reads_back_equal'] else 'NO':>10} "
                     f"{ratio if r['writer'] == 'mmpack' else '':>10}")
    lines.append(f"{report['clips']} real clips through bench.voice.features (log-mel [T, 80] float16, pitch [T] "
                 f"float32, speaker), the median of {report['rounds']} alternating runs; reads back: the first 8 "
                 "samples read equal to the function's output" +
                 ("" if report["litdata"] else "; LitData: not installed here (bench/peers-requirements.txt)"))
    return "\n".join(lines)


def plot_map(report: dict, path: Path) -> None:
    from .report import _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    writers = sorted({r["writer"] for r in report["rows"]})
    for k, writer in enumerate(writers):
        rows = [r for r in report["rows"] if r["writer"] == writer]
        ax.bar([r["workers"] + 0.35 * (k - (len(writers) - 1) / 2) for r in rows],
               [r["samples_per_s"] for r in rows], width=0.35, label=writer)
    ax.set_xticks(sorted({r["workers"] for r in report["rows"]}))
    ax.set_xlabel("workers")
    ax.set_ylabel("samples / s")
    ax.set_title("a voice model's features, computed once and written")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
