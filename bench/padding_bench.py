"""`bench loaders --padding`: what batches of random lengths spend on padding, and what
`bucket_by="length"` and `max_tokens` save of it, on real length distributions (the test
suite's kinds of data: real recordings as whole clips, captions) and a skewed one (documents of
lognormal lengths, as speech durations are), at one batch size. Per row: the padding share, the
useful (real) elements a second of the loader alone and of a loop whose stand-in step takes time
in proportion to the elements it computes on, as a GPU's does; and the spread of the cost of
the batches that 8 ranks take at one step (the slowest sets the step). Batches cut from the
sorted lengths are the least padding a fixed batch size allows (a figure from the lengths, no
loader)."""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import data, report
from .loaders_bench import machine
from .prepare import prepare_dataset
from .measure import MachineLoad

STEP_MS = 5.0  # the stand-in step of a random batch of the mean padded size; others in proportion to theirs
RANKS = 8  # the ranks whose step costs are compared


def make_skewed(raw: Path, count: int, *, seed: int = 0) -> Path:
    """RAW/docs.jsonl: `count` documents of lognormal lengths (median 40 words, sigma 1), words
    of the stdlib's docstrings and comments (real text for the tokenizer)."""
    rng = random.Random(seed)
    words = " ".join(data.caption_lines(2000, seed=seed)).split()
    raw.mkdir(parents=True, exist_ok=True)
    with open(raw / "docs.jsonl", "w", encoding="utf-8") as f:
        for _ in range(count):
            n = max(1, min(4000, round(rng.lognormvariate(np.log(40), 1.0))))
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}) + "\n")
    return raw


def prepare(work: Path, args) -> list[dict]:
    """The three datasets, built once in `work`: (name, dir, column, what an element is)."""
    from .sounds import make_audio_folders

    tokenizer = data.minilm_tokenizer()
    _, audio, _ = prepare_dataset(work, "audio", args.clips, lambda r: make_audio_folders(r, args.clips, seed=0),
                                  {"sample_rate": 16000, "shard_size": "64MB"})
    _, pairs, _ = prepare_dataset(work, "padding-pairs", args.images,
                                  lambda r: data.make_pairs(r, args.images, seed=2, max_side=96),
                                  {"tokenizer": tokenizer, "image_size": 32})
    _, skewed, _ = prepare_dataset(work, "skewed", args.docs, lambda r: make_skewed(r, args.docs),
                                   {"tokenizer": tokenizer})
    return [{"name": "audio (real clips, 16 kHz)", "dir": audio, "column": "audio", "element": "frame"},
            {"name": "captions", "dir": pairs, "column": "tokens", "element": "token"},
            {"name": "skewed (lognormal documents)", "dir": skewed, "column": "tokens", "element": "token"}]


def rows_of(batch: int, mean_length: float) -> list[tuple[str, dict]]:
    budget = int(round(batch * mean_length))
    return [("random batches", {"batch_size": batch}),
            ("bucket_by='length'", {"batch_size": batch, "bucket_by": "length"}),
            (f"max_tokens={budget:,}", {"max_tokens": budget})]


def run_row(ds, options: dict, *, ns_per_element: float, min_batches: int) -> dict:
    """A warm epoch, then whole epochs timed alone and with the stand-in step, until at least
    `min_batches` batches each: padding (over every timed epoch: each cuts its windows at another
    phase) and useful elements a second."""
    from loaders import Loader

    loader = Loader(ds, seed=0, **options)
    for _ in loader:  # warm: maps, buffers, the first epoch's plan
        pass
    out = {}
    for mode in ("alone", "step"):
        batches = samples = real = padded = 0
        started = time.perf_counter()
        while batches < min_batches:
            for _ in loader:
                got = loader.padding.batch
                batches, samples, real, padded = batches + 1, samples + got["samples"], real + got["real"], padded + got["padded"]
                if mode == "step":
                    time.sleep(got["padded"] * ns_per_element * 1e-9)
        seconds = time.perf_counter() - started
        out[mode] = {"batches": batches, "samples": samples, "real": real, "padded": padded, "seconds": seconds,
                     "useful_per_s": real / seconds}
    alone = out["alone"]
    ranks = [Loader(ds, seed=0, rank=r, world_size=RANKS, **options).epochs for r in range(RANKS)]
    return {**options, "padding": 1 - alone["real"] / alone["padded"], "samples_per_batch": alone["samples"] / alone["batches"],
            "over_budget": loader.padding.epochs[0].get("over_budget"), "useful_per_s": alone["useful_per_s"],
            "useful_per_s_step": out["step"]["useful_per_s"], "timed": out,
            "step_spread": step_spread(ranks, _lengths(loader))}


def step_spread(ranks, lengths) -> float:
    """The mean over an epoch's steps on len(ranks) ranks (each rank's epochs) of (the dearest
    rank's batch / the mean rank's) - 1, in padded elements: what a step waits for its slowest rank."""
    costs = []
    for epochs in ranks:
        p = epochs.upcoming()
        costs.append([len(ids) * int(lengths(ids).max(initial=0)) for ids in
                      (epochs.batch_ids(p, b) for b in epochs.batches(p))])
    steps = np.asarray(costs, np.float64).T  # [steps, ranks]
    return float(np.mean(steps.max(axis=1) / np.maximum(steps.mean(axis=1), 1) - 1))


def _lengths(loader):
    from loaders.source import RaggedLengths, length_column

    gather = loader.source
    return RaggedLengths(gather.readers, length_column(gather, None))


def plan_rows(batch: int, n: int) -> list[dict]:
    """The same rows over n log-logistic lengths (`sampler_bench.SkewedLengths`), from the plans
    alone (no data): padding and the step spread on RANKS ranks where windows are full."""
    from loaders.order.lengths import Budget
    from loaders.order.sampler import Epochs

    from .sampler_bench import SkewedLengths

    lengths = SkewedLengths()
    every = lengths(np.arange(n))
    name = f"skewed, {n:,} lengths (plans alone)"
    rows = [{"dataset": name, "system": "batches cut from the sorted lengths", "padding": sorted_padding(every, batch),
             "samples": n, "mean_length": float(every.mean())}]
    budget = int(round(batch * every.mean()))
    for system, make in (("random batches", lambda r: Epochs(n, batch, shuffle=True, order=None, seed=0, drop_last=False,
                                                              rank=r, world_size=RANKS)),
                         ("bucket_by='length'", lambda r: _planned(n, Budget(batch_size=batch), r)),
                         (f"max_tokens={budget:,}", lambda r: _planned(n, Budget(max_tokens=budget), r))):
        ranks = [make(r) for r in range(RANKS)]
        passes = [epochs.upcoming() for epochs in ranks]
        batches = [ranks[r].batch_ids(passes[r], b) for r in range(RANKS) for b in ranks[r].batches(passes[r])]
        real = sum(int(every[b].sum()) for b in batches)
        padded = sum(len(b) * int(every[b].max()) for b in batches)
        rows.append({"dataset": name, "system": system, "padding": 1 - real / padded,
                     "samples_per_batch": sum(map(len, batches)) / len(batches), "step_spread": step_spread(ranks, lengths)})
    return rows


def _planned(n: int, budget, rank: int):
    from loaders.order.planned import DatasetOrder, LengthEpochs

    from .sampler_bench import SkewedLengths

    return LengthEpochs(n, budget, positions_of=DatasetOrder(n, 8192), lengths=SkewedLengths(), bucket_by="length",
                        column="tokens", shuffle=True, order=None, seed=0, drop_last=False, rank=rank, world_size=RANKS)


def sorted_padding(lengths: np.ndarray, batch: int) -> float:
    """The padding of batches cut from the sorted lengths: the least a fixed batch size allows."""
    s = np.sort(lengths)
    ends = np.minimum(np.arange(batch, len(s) + batch, batch), len(s))
    longest, sizes = s[ends - 1], np.diff(np.concatenate([[0], ends]))
    return 1 - s.sum() / float((longest * sizes).sum())


def bench_padding(args) -> dict:
    from loaders import MMapDataset

    load = MachineLoad()
    work = Path(args.work or tempfile.mkdtemp(prefix="mmpack-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    batch, results = args.batch_size, []
    for d in prepare(work, args):
        ds = MMapDataset(d["dir"], columns=[d["column"], "key"])
        lengths = _lengths_all(ds, d["column"])
        mean_padded_random = None
        reference = {"dataset": d["name"], "system": "batches cut from the sorted lengths", "padding":
                     sorted_padding(lengths, batch), "samples": len(lengths), "mean_length": float(lengths.mean())}
        results.append(reference)
        for name, options in rows_of(batch, float(lengths.mean())):
            if mean_padded_random is None:  # the stand-in step: STEP_MS for the mean random batch
                s = np.random.default_rng(0).permutation(lengths)[: len(lengths) // batch * batch].reshape(-1, batch)
                mean_padded_random = float((s.max(axis=1) * batch).mean()) if len(s) else float(lengths.max())
            ns = STEP_MS * 1e6 / mean_padded_random
            row = {"dataset": d["name"], "system": name, "element": d["element"],
                   **run_row(ds, options, ns_per_element=ns, min_batches=args.padding_batches)}
            results.append(row)
            print(f"  measured {d['name']}: {name}: {100 * row['padding']:.1f}% padding", file=sys.stderr, flush=True)
        _against(results, d["name"])
    results += plan_rows(batch, args.plan_lengths)
    _against(results, results[-1]["dataset"])
    return {"command": "bench loaders --padding", "machine": machine(), "load": load.report(), "batch_size": batch,
            "step_ms": STEP_MS, "ranks": RANKS, "results": results, "cores": os.cpu_count(),
            "notes": [f"the stand-in step sleeps {STEP_MS} ms for a random batch of the mean padded size, the "
                      "others in proportion to their padded elements (a GPU computes on the zeros too)",
                      "useful elements: the samples' own (real) frames or tokens; padding = 1 - real / padded"]}


def _lengths_all(ds, column: str) -> np.ndarray:
    from loaders.source import RaggedLengths

    return RaggedLengths([ds.reader], column)(np.arange(len(ds)))


def _against(results: list[dict], dataset: str) -> None:
    """Each row of `dataset` against its random batches and the sorted lengths' padding."""
    rows = [r for r in results if r["dataset"] == dataset]
    ref = rows[0]["padding"]
    random_row = next(r for r in rows if r["system"] == "random batches")
    for r in rows[1:]:
        r["x_sorted_padding"] = r["padding"] / ref if ref else None
        if "useful_per_s" in r and "useful_per_s" in random_row:
            r["x_random_useful"] = r["useful_per_s"] / random_row["useful_per_s"]
            r["x_random_useful_step"] = r["useful_per_s_step"] / random_row["useful_per_s_step"]


def padding_table(rep: dict) -> str:
    lines = [f"batch {rep['batch_size']}: padding share, and useful elements/s of the loader alone and with a stand-in "
             f"step ({rep['step_ms']} ms for the mean random batch, in proportion to padded elements); step spread: "
             f"the dearest of {rep['ranks']} ranks' batches over the mean, per step",
             f"{'dataset':36} {'batches':38} {'padding':>8} {'x sorted':>8} {'samples/b':>9} {'useful/s':>12} "
             f"{'x random':>8} {'with step':>12} {'x random':>8} {'spread@8':>8}"]
    for r in rep["results"]:
        head = f"{r['dataset']:36} {r['system']:38} {100 * r['padding']:>7.1f}%"
        if "samples_per_batch" not in r:
            lines.append(f"{head} {'':>8} ({r['samples']:,} samples, mean length {r['mean_length']:,.0f})")
            continue
        if "useful_per_s" not in r:
            lines.append(f"{head} {report._f(r.get('x_sorted_padding'), '>8.2f')} {r['samples_per_batch']:>9.1f} "
                         f"{'-':>12} {'-':>8} {'-':>12} {'-':>8} {100 * r['step_spread']:>7.1f}%")
            continue
        lines.append(f"{head} {report._f(r.get('x_sorted_padding'), '>8.2f')} {r['samples_per_batch']:>9.1f} "
                     f"{r['useful_per_s']:>12,.0f} {report._f(r.get('x_random_useful'), '>8.2f')} "
                     f"{r['useful_per_s_step']:>12,.0f} {report._f(r.get('x_random_useful_step'), '>8.2f')} "
                     f"{100 * r['step_spread']:>7.1f}%")
    return "\n".join(lines)


def plot_padding(rep: dict, path: Path) -> None:
    """Padding share per dataset, and useful elements/s with the stand-in step (x random batches)
    per dataset a loader ran on."""
    import textwrap

    plt = report._plt()
    systems = list(dict.fromkeys(r["system"].split("=")[0] for r in rep["results"]))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(systems)
    for ax, key, title in ((axes[0], "padding", "padding, % of the batch's elements"),
                           (axes[1], "x_random_useful_step", "useful elements/s with the step, x random batches")):
        datasets = list(dict.fromkeys(r["dataset"] for r in rep["results"] if key == "padding" or "useful_per_s" in r))
        for i, system in enumerate(systems):
            rows = [next((r for r in rep["results"] if r["dataset"] == d and r["system"].split("=")[0] == system), {})
                    for d in datasets]
            scale = 100 if key == "padding" else 1
            default = 1.0 if key != "padding" and system == "random batches" else 0.0
            ax.bar(np.arange(len(datasets)) + i * width, [scale * r.get(key, default) for r in rows], width, label=system)
        ax.set_xticks(np.arange(len(datasets)) + 0.4 - width / 2, [textwrap.fill(d, 18) for d in datasets], fontsize=8)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"bench loaders --padding, batch {rep['batch_size']} ({rep['machine']['cores']} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
