"""`bench loaders`: one run, same data, side by side: the machine's memcpy bandwidth, mmpack's
loaders, DataLoader over MMapDataset with default collate, and the on-the-fly baseline (Pillow
decode + resize in DataLoader workers). Every figure is also a fraction of memcpy and a ratio
to the baseline, measured in the same run. Prints a table; `--json PATH` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from . import data

PIN = torch.cuda.is_available()  # pin_memory=True without CUDA only warns
PEERS = {"webdataset": "webdataset", "litdata": "litdata", "streaming": "mosaicml-streaming", "datasets": "datasets"}


class OnTheFly(torch.utils.data.Dataset):
    """The baseline users have today: an ImageFolder-style Dataset decoding in workers."""

    def __init__(self, files, labels, size):
        self.files, self.labels, self.size = files, labels, size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from packer.images import decode_image

        return {"image": torch.from_numpy(decode_image(self.files[i], self.size)), "label": self.labels[i]}


def memcpy_rate(nbytes: int, reps: int = 10) -> float:
    """Bytes/s of one-thread numpy copies between two pre-touched buffers of `nbytes`."""
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def timed(make_iter, count_of, passes: int, limit: int | None = None) -> dict:
    """Median samples/s over `passes` full passes after a warm-up pass; time to first batch."""
    rates, first = [], None
    for p in range(passes + 1):
        start = time.perf_counter()
        n = 0
        for i, batch in enumerate(make_iter()):
            if i == 0 and p == 1:
                first = time.perf_counter() - start
            n += count_of(batch)
            if limit and n >= limit:
                break
        if p:
            rates.append(n / (time.perf_counter() - start))
    return {"samples_per_s": statistics.median(rates), "first_batch_s": first}


def bench_loaders(args) -> dict:
    from loaders import Loader, MMapDataset, TokenWindows
    from packer.cli import main as packer

    work = Path(args.work or tempfile.mkdtemp(prefix="mmpack-bench-"))
    raw, out = work / "raw-images", work / "out-images"
    if not (out / "manifest.json").exists():
        data.make_image_folders(raw, args.images, seed=0)
        packer(["build", str(raw), str(out), "-q", "--overwrite"])
    ds = MMapDataset(out)
    bs, passes = args.batch_size, args.passes
    sample_bytes = ds.columns["image"].sample_nbytes
    memcpy = memcpy_rate(bs * sample_bytes)
    results = []

    def row(name, r, kind="images"):
        r.update(system=name, kind=kind)
        if kind == "images":
            r["mb_per_s"] = r["samples_per_s"] * sample_bytes / 1e6
            r["pct_memcpy"] = 100 * r["samples_per_s"] * sample_bytes / memcpy
        results.append(r)

    for threads in sorted({1, os.cpu_count() or 1}):
        loader = Loader(ds, bs, columns=["image", "label"], num_threads=threads)
        row(f"mmpack Loader, {threads} thread(s)", timed(lambda: loader, lambda b: len(b["label"]), passes))
    batched = ds.batched(bs, columns=["image", "label"])
    row("mmpack batched + DataLoader(2 workers)", timed(
        lambda: torch.utils.data.DataLoader(batched, batch_size=None, num_workers=2, pin_memory=PIN),
        lambda b: len(b["label"]), passes))
    plain = MMapDataset(out, columns=["image", "label"])
    row("MMapDataset + DataLoader(2 workers, collate)", timed(
        lambda: torch.utils.data.DataLoader(plain, batch_size=bs, shuffle=True, num_workers=2, pin_memory=PIN),
        lambda b: len(b["label"]), passes))
    files = sorted(p for p in raw.rglob("*") if p.is_file())
    classes = sorted({p.parent.name for p in files})
    otf = OnTheFly(files, [classes.index(p.parent.name) for p in files], 224)
    row("on-the-fly Pillow + DataLoader(2 workers)", timed(
        lambda: torch.utils.data.DataLoader(otf, batch_size=bs, shuffle=True, num_workers=2, pin_memory=PIN),
        lambda b: len(b["label"]), 1, limit=min(len(otf), 4 * bs)))

    text_out = work / "out-text"
    if not (text_out / "manifest.json").exists():
        data.make_text(work / "raw-text", int(args.text_mb * 1024**2))
        packer(["build", str(work / "raw-text"), str(text_out), "--tokenizer", str(data.minilm_tokenizer()),
                "--append-eos", "-q", "--overwrite"])
    tw = TokenWindows(text_out, 1024)
    tloader = Loader(tw, 32)
    r = timed(lambda: tloader, lambda b: b[0].numel(), passes)
    r["tokens_per_s"] = r.pop("samples_per_s")
    r["pct_memcpy"] = 100 * r["tokens_per_s"] * 8 / memcpy  # int64 tokens written
    row("mmpack TokenWindows(1024) via Loader", r, kind="tokens")

    base = next(r["samples_per_s"] for r in results if r["system"].startswith("on-the-fly"))
    collate = next(r["samples_per_s"] for r in results if r["system"].startswith("MMapDataset"))
    for r in results:
        if r["kind"] == "images":
            r["x_on_the_fly"] = r["samples_per_s"] / base
            r["x_dataloader_collate"] = r["samples_per_s"] / collate
    peers = {mod: ("installed, adapter not written yet" if _importable(mod) else f"not installed: pip install {pip}")
             for mod, pip in PEERS.items()}
    return {
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "numpy": np.__version__, "cuda": torch.cuda.is_available(), "platform": platform.platform()},
        "memcpy_bytes_per_s": memcpy, "memcpy_images_per_s": memcpy / sample_bytes,
        "batch_size": bs, "num_images": len(ds), "image_shape": list(ds.columns["image"].shape),
        "results": results, "peers": peers, "cache": "warm (cold needs root to drop the page cache; not done)",
    }


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def print_table(report: dict) -> None:
    print(f"memcpy (1 thread, {report['batch_size']}-image buffers): {report['memcpy_bytes_per_s'] / 1e9:.1f} GB/s "
          f"= {report['memcpy_images_per_s']:,.0f} images/s; {report['num_images']} images {report['image_shape']}")
    print(f"{'system':46} {'samples/s':>12} {'MB/s':>8} {'% memcpy':>9} {'x on-the-fly':>13} {'x collate':>10} {'1st batch s':>11}")
    for r in report["results"]:
        rate = r.get("samples_per_s", r.get("tokens_per_s"))
        unit = " tok/s" if r["kind"] == "tokens" else ""
        print(f"{r['system']:46} {rate:>12,.0f} {r.get('mb_per_s', float('nan')):>8,.0f} {r['pct_memcpy']:>8.0f}% "
              f"{r.get('x_on_the_fly', float('nan')):>13.1f} {r.get('x_dataloader_collate', float('nan')):>10.1f} "
              f"{(r['first_batch_s'] or 0):>11.3f}{unit}")
    for name, state in report["peers"].items():
        print(f"peer {name:12} {state}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench", description="mmpack benchmarks")
    sub = ap.add_subparsers(dest="command", required=True)
    lo = sub.add_parser("loaders", help="loaders side by side on the same data, against memcpy")
    lo.add_argument("--images", type=int, default=3000)
    lo.add_argument("--text-mb", type=float, default=8)
    lo.add_argument("--batch-size", type=int, default=256)
    lo.add_argument("--passes", type=int, default=3)
    lo.add_argument("--quick", action="store_true", help="small sizes: finishes in about a minute on 2 cores")
    lo.add_argument("--work", type=Path, help="keep the built datasets here and reuse them")
    lo.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args(argv)
    if args.quick:
        args.images, args.text_mb, args.passes = min(args.images, 1024), min(args.text_mb, 2), min(args.passes, 2)
    report = bench_loaders(args)
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
