"""`bench packer`: build throughput against the raw per-core rates of the work it wraps
(Pillow decode + resize, `tokenizers` batch encode), measured in the same run, for each worker
count (with `--cold`, image builds from inputs evicted from the page cache too); peak memory of
the build's process tree; zstd pack/unpack ratio and MB/s."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from . import data
from .loaders_bench import machine, prepare_images, prepare_text
from .measure import PeakMemory, evict

_TOKENIZE_ONE_CORE = """
import json, sys, time
from packer.sources import scan
from packer.text import Document, encode_batch, iter_documents, load_tokenizer
tok = load_tokenizer(sys.argv[1])
texts = [d.text for r in scan(sys.argv[2]).records for d in iter_documents(r) if isinstance(d, Document)]
start = time.perf_counter(); n = 0
for i in range(0, len(texts), 512):
    n += sum(a.size for a in encode_batch(tok, texts[i:i + 512], dtype="<u4", eos_id=None, add_special_tokens=False))
print(json.dumps({"tokens": n, "seconds": time.perf_counter() - start}))
"""


def raw_image_rate(files: list[Path], size: int) -> float:
    """Images/s of decode_image (Pillow, the packer's exact policy) on one core, in this process."""
    from packer.errors import SourceError
    from packer.images import decode_image

    start, n = time.perf_counter(), 0
    for f in files:
        try:
            decode_image(f, size)
            n += 1
        except SourceError:
            pass
    return n / (time.perf_counter() - start)


def raw_token_rate(raw: Path) -> float:
    """Tokens/s of `tokenizers` batch encode on one core (RAYON_NUM_THREADS=1, a fresh process) of
    every document of RAW (.txt, JSONL, Parquet), read into memory before the clock starts."""
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "true"}
    res = subprocess.run([sys.executable, "-c", _TOKENIZE_ONE_CORE, str(data.minilm_tokenizer()), str(raw)],
                         capture_output=True, text=True, env=env, check=True)
    r = json.loads(res.stdout)
    return r["tokens"] / r["seconds"]


def _build(raw: Path, out: Path, workers: int, extra: list[str], raw_rate: Callable[[], float],
           rounds: int, before: Callable[[], object] = lambda: None) -> dict:
    """`packer build` as a user runs it, in a fresh process, `rounds` times, with the raw
    per-core rate measured before the first and after every build (this VM's speed drifts by
    10% within minutes; raw and build alternate so that both see the same drift). Each build's
    time is its own clock (manifest build.seconds: scan to published manifest, no interpreter
    start-up) in a run with nothing else on the cores; peak memory of the build's process tree
    (not this one's) comes from one more run, sampled every 50 ms (the sampling takes CPU from
    a 2-core build, so it never shares a run with the timing). `before()` runs before every build
    (evicting the inputs from the page cache, for cold builds)."""
    from packer import load_manifest

    cmd = [sys.executable, "-m", "packer.cli", "build", str(raw), str(out), "-q", "--workers", str(workers), *extra]
    raws, seconds = [raw_rate()], []
    for _ in range(rounds):
        shutil.rmtree(out, ignore_errors=True)
        before()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        seconds.append(load_manifest(out).build["seconds"])
        raws.append(raw_rate())
    shutil.rmtree(out, ignore_errors=True)
    before()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    with PeakMemory(every_s=0.05, root=proc.pid) as mem:
        if proc.wait():
            raise subprocess.CalledProcessError(proc.returncode, cmd)
    m = load_manifest(out)
    return {"seconds": statistics.mean(seconds), "seconds_runs": seconds, "raw_per_core": statistics.mean(raws),
            "raw_per_core_runs": raws, "cores_used": m.build["cores_used"], "samples": m.num_samples,
            "shards": len(m.shards), "size_bytes": m.size_bytes,
            "peak_rss_mb": mem.peak_rss_mb, "peak_pss_mb": mem.peak_pss_mb}


def _row(what: str, workers: int, unit: str, units: int, r: dict, inputs: str = "cached") -> dict:
    """Efficiency = mean build rate / (mean raw per-core rate x cores used)."""
    rate = statistics.mean(units / s for s in r["seconds_runs"])
    ideal = r["raw_per_core"] * r["cores_used"]
    return {"what": what, "workers": workers, "inputs": inputs, "rate": rate, "unit": unit,
            "efficiency": rate / ideal, "efficiency_runs": [units / s / ideal for s in r["seconds_runs"]], **r}


def bench_packer(args) -> dict:
    from packer.archive import pack, unpack

    work = Path(args.work or tempfile.mkdtemp(prefix="mmpack-bench-packer-"))
    work.mkdir(parents=True, exist_ok=True)
    raw_img, _, _ = prepare_images(work, args.images)
    raw_txt, _, _ = prepare_text(work, args.text_mb)
    img_files = sorted(p for p in raw_img.rglob("*") if p.is_file())
    txt_files = sorted(p for p in raw_txt.rglob("*") if p.is_file())
    rows = []
    shard, text_shard = args.shard_size, args.text_shard_size or args.shard_size
    tokenizer = ["--tokenizer", str(data.minilm_tokenizer()), "--append-eos", "--shard-size", text_shard]
    for w in args.workers_list:
        for inputs in ("cached", "cold") if args.cold else ("cached",):  # cold: evicted before each build
            before = (lambda: evict(img_files)) if inputs == "cold" else (lambda: None)
            r = _build(raw_img, work / f"pk-images-{w}", w, ["--shard-size", shard],
                       lambda: raw_image_rate(img_files, 224), args.rounds, before)
            rows.append(_row("images", w, "images/s", r["samples"], r, inputs))
        r = _build(raw_txt, work / f"pk-text-{w}", w, tokenizer, lambda: raw_token_rate(raw_txt), args.rounds)
        rows.append(_row("tokens", w, "tokens/s", _token_count(work / f"pk-text-{w}"), r))
    archives = []
    last = args.workers_list[-1]
    for what in ("images", "text"):
        src = work / f"pk-{what}-{last}"
        arc, back = work / f"arc-{what}", work / f"unpacked-{what}"
        p = pack(src, arc, level=args.level, overwrite=True)
        u = unpack(arc, back, overwrite=True)
        archives.append({"what": what, "level": args.level, "raw_bytes": p.raw_bytes, "zstd_bytes": p.packed_bytes,
                         "ratio": p.ratio, "pack_mb_per_s": p.mb_per_s, "unpack_mb_per_s": u.mb_per_s})
    return {"command": "bench packer", "machine": machine(), "shard_size": shard, "text_shard_size": text_shard,
            "builds": rows,
            "archives": archives, "images": len(img_files), "text_files": len(txt_files)}


def _token_count(out: Path) -> int:
    from packer.reader import DatasetReader

    reader = DatasetReader(out)
    return sum(int(reader.column(k, "tokens").offsets[-1]) for k in range(len(reader.manifest.shards)))
