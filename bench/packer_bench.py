"""`bench packer`: build throughput against the raw per-core rates of the work it wraps
(Pillow decode + resize, `tokenizers` batch encode; a core alone and a core among as many busy
ones as the build used), measured in the same run, for each worker
count (with `--cold`, image builds from inputs evicted from the page cache too); peak memory of
the build's process tree; zstd pack/unpack ratio and MB/s."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from packer.system import link_or_copy

from . import data
from .loaders_bench import machine
from .prepare import prepare_images, prepare_text
from .measure import PeakMemory, disk_write_rate, evict

# The raw image rate is a rate: an evenly spread sample of the photos gives it, in a fraction of
# the time every one of them takes on one core (measured before and after every build, it was
# most of a row's time on a many-core host).
RAW_IMAGES, RAW_IMAGES_PER_PROCESS = 1000, 150

_RAW_ONE_CORE = """
import json, sys, time
what, raw, part, parts, tokenizer, most = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
if what == "images":
    from pathlib import Path
    from packer.errors import SourceError
    from packer.builder.images import decode_image
    files = sorted(p for p in Path(raw).rglob("*") if p.is_file())
    files = files[::max(1, len(files) // most)][part::parts]  # every k-th: each class folder's share kept

    def run():
        n = 0
        for f in files:
            try:
                decode_image(f, 224)
                n += 1
            except SourceError:
                pass
        return n
else:
    from packer.builder.scan import scan
    from packer.builder.text import Document, encode_batch, iter_documents, load_tokenizer
    tok = load_tokenizer(tokenizer)
    texts = [d.text for r in scan(raw).records for d in iter_documents(r) if isinstance(d, Document)][part::parts]

    def run():
        return sum(a.size for i in range(0, len(texts), 512) for a in encode_batch(
            tok, texts[i:i + 512], dtype="<u4", eos_id=None, add_special_tokens=False))
print("ready", flush=True)
sys.stdin.readline()
start = time.perf_counter()
n = run()
print(json.dumps({"units": n, "seconds": time.perf_counter() - start}))
"""


def raw_rate(what: str, raw: Path, processes: int = 1) -> float:
    """Per-core rate of the raw work alone: Pillow decode + resize to 224 (the packer's exact
    policy), images/s, of an evenly spread sample of RAW's images (at least RAW_IMAGES), each
    read from its file inside the clock, as a build reads it, or `tokenizers` batch encode,
    tokens/s, of every document of RAW, read into memory before the clock starts. `processes`
    fresh processes with one core each (one Rust thread) share the inputs and start together
    once all are loaded: 1 gives the rate of a core alone; N gives a core's rate while N cores
    do the same work, i.e. how the raw work itself scales on this machine (shared caches,
    memory, clock), which no build can beat."""
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "true"}
    most = max(RAW_IMAGES, RAW_IMAGES_PER_PROCESS * processes)
    procs = [subprocess.Popen([sys.executable, "-c", _RAW_ONE_CORE, what, str(raw), str(part), str(processes),
                               str(data.minilm_tokenizer()), str(most)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env) for part in range(processes)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"raw {what} rate: a measuring process failed (exit {p.wait()})")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        runs = [json.loads(p.communicate()[0]) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return statistics.mean(r["units"] / r["seconds"] for r in runs)


def _build(what: str, raw: Path, out: Path, workers: int, extra: list[str], rounds: int,
           before: Callable[[], object] = lambda: None, raw_files: Path | None = None) -> dict:
    """`packer build` as a user runs it, in a fresh process, `rounds` times, with the raw rate
    of a core alone measured before the first build and after every build, and the raw rate of
    a core among the build's cores used all busy after every build (this VM's speed drifts by
    10% within minutes; raw and build alternate so that both see the same drift). Each build's
    time is its own clock (manifest build.seconds: scan to published manifest, no interpreter
    start-up) in a run with nothing else on the cores; peak memory of the build's process tree
    (not this one's) comes from one more run, sampled every 50 ms (the sampling takes CPU from
    a 2-core build, so it never shares a run with the timing). `before()` runs before every build
    (evicting the inputs from the page cache, for cold builds). `raw_files`: where the raw rate
    reads the same inputs as files (RAW in another input form: the images it holds)."""
    from packer import load_manifest

    rated = raw_files or raw
    cmd = [sys.executable, "-m", "packer", "build", str(raw), str(out), "-q", "--workers", str(workers), *extra]
    alone, busy, seconds, waits = [raw_rate(what, rated)], [], [], []
    for _ in range(rounds):
        shutil.rmtree(out, ignore_errors=True)
        before()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        m = load_manifest(out)
        seconds.append(m.build["seconds"])
        waits.append(m.build.get("disk_wait") or 0.0)
        alone.append(raw_rate(what, rated))
        cores = m.build["cores_used"]
        busy.append(raw_rate(what, rated, cores) if cores > 1 else alone[-1])
    shutil.rmtree(out, ignore_errors=True)
    before()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    with PeakMemory(every_s=0.05, root=proc.pid) as mem:
        if proc.wait():
            raise subprocess.CalledProcessError(proc.returncode, cmd)
    m = load_manifest(out)
    return {"seconds": statistics.mean(seconds), "seconds_runs": seconds, "raw_per_core": statistics.mean(alone),
            "raw_per_core_runs": alone, "raw_per_core_busy": statistics.mean(busy), "raw_per_core_busy_runs": busy,
            "cores_used": m.build["cores_used"], "disk_wait": statistics.mean(waits), "samples": m.num_samples,
            "shards": len(m.shards), "size_bytes": m.size_bytes,
            "peak_rss_mb": mem.peak_rss_mb, "peak_pss_mb": mem.peak_pss_mb}


# A build shorter than this is mostly its start-up (worker processes, scan, publish): its rate says
# little of how the work scales with workers, and the table marks it with what would be long enough
SHORT_BUILD_S = 5.0


def _row(what: str, workers: int, unit: str, units: int, r: dict, disk: float, inputs: str = "cached") -> dict:
    """efficiency = the median over the timed builds of a build's rate / (the raw rate of a core
    alone, the mean of the passes right before and after it, x cores used): the issue's target;
    efficiency_busy = the same against a core's raw rate with all cores used doing the raw work,
    measured right after the build (what the machine's cores can give, without anything of the
    build); raw_scaling = busy / alone, of the passes made one after the other, how much of the
    linear ideal the raw work itself reaches on these cores;
    pct_disk = bytes written per second of build against the output device's write rate `disk`
    (near 100%: the disk, not the cores, sets the pace); disk_wait (in `r`) = the share of the
    workers' time spent waiting on writes and fsyncs, as the build measures it itself."""
    rates = [units / s for s in r["seconds_runs"]]
    written = r["size_bytes"] / r["seconds"]
    cores, alone, busy = r["cores_used"], r["raw_per_core_runs"], r["raw_per_core_busy_runs"]
    # each build against the raw rates measured right before and after it: the machine's drift
    # over the run cancels, where a ratio of means over the run keeps it
    runs = [x / (cores * (a + b) / 2) for x, a, b in zip(rates, alone, alone[1:])]
    runs_busy = [x / (cores * b) for x, b in zip(rates, busy)]
    return {"what": what, "workers": workers, "inputs": inputs, "rate": statistics.mean(rates), "unit": unit,
            "units": units, "efficiency": statistics.median(runs), "efficiency_runs": runs,
            "efficiency_busy": statistics.median(runs_busy), "efficiency_busy_runs": runs_busy,
            "raw_scaling": statistics.median(b / a for b, a in zip(busy, alone[1:])), "written_bytes_per_s": written,
            "pct_disk": 100 * written / disk, "short": r["seconds"] < SHORT_BUILD_S,
            # the units that would keep this many cores busy SHORT_BUILD_S at the busy raw rate
            "units_for_long_enough": math.ceil(SHORT_BUILD_S * cores * statistics.median(busy)), **r}


def _progress(row: dict) -> dict:
    """A line per measured row (a row takes a minute and more on one worker)."""
    form = f", {row['input']}" if row.get("input", "folder") != "folder" else ""
    print(f"  measured {row['what']} ({row['inputs']}{form}) on {row['workers']} worker(s): {row['rate']:,.0f} "
          f"{row['unit']}, {100 * row['efficiency']:.0f}% of the raw rate x cores", file=sys.stderr, flush=True)
    return row


def bench_packer(args) -> dict:
    from packer.dataset.archive import pack, unpack

    work = Path(args.work or tempfile.mkdtemp(prefix="mmpack-bench-packer-"))
    work.mkdir(parents=True, exist_ok=True)
    # several input forms: the folder's copies are files of their own, as a tar's or a Parquet
    # file's are bytes of their own; hard links would read a third of the pages for the folder
    # alone (3 copies), which on a VM whose fresh pages cost was the forms' whole gap
    raw_img = _linked(prepare_images(work, args.images)[0], args.link_copies, real=len(args.input) > 1)
    raw_txt, _, _ = prepare_text(work, args.text_mb)
    img_files = sorted(p for p in raw_img.rglob("*") if p.is_file())
    txt_files = sorted(p for p in raw_txt.rglob("*") if p.is_file())
    rows = []
    disk = disk_write_rate(work)  # where the builds write: is the output device their limit?
    shard, text_shard = args.shard_size, args.text_shard_size or args.shard_size
    tokenizer = ["--tokenizer", str(data.minilm_tokenizer()), "--append-eos", "--shard-size", text_shard]
    forms = {form: raw_img if form == "folder" else data.folder_as(form, raw_img, work / f"raw-{form}-{raw_img.name}")
             for form in args.input}
    for w in args.workers_list:
        for form, raw in forms.items():
            for inputs in ("cached", "cold") if args.cold else ("cached",):  # cold: evicted before each build
                before = (lambda: evict(img_files)) if inputs == "cold" else (lambda: None)
                r = _build("images", raw, work / f"pk-images-{form}-{w}", w, ["--shard-size", shard], args.rounds,
                           before, raw_files=raw_img)
                rows.append(_progress({**_row("images", w, "images/s", r["samples"], r, disk, inputs), "input": form,
                                       "input_bytes": _bytes_under(raw)}))
        if args.text_mb:
            r = _build("tokens", raw_txt, work / f"pk-text-{w}", w, tokenizer, args.rounds)
            rows.append(_progress(_row("tokens", w, "tokens/s", _token_count(work / f"pk-text-{w}"), r, disk)))
    archives = []
    last = args.workers_list[-1]
    for what in ("images", "text") if args.text_mb else ("images",):
        src = work / (f"pk-images-{args.input[0]}-{last}" if what == "images" else f"pk-text-{last}")
        arc, back = work / f"arc-{what}", work / f"unpacked-{what}"
        p = pack(src, arc, level=args.level, overwrite=True)
        u = unpack(arc, back, overwrite=True)
        archives.append({"what": what, "level": args.level, "raw_bytes": p.raw_bytes, "zstd_bytes": p.packed_bytes,
                         "ratio": p.ratio, "pack_mb_per_s": p.mb_per_s, "unpack_mb_per_s": u.mb_per_s})
    return {"command": "bench packer", "machine": machine(), "shard_size": shard, "text_shard_size": text_shard,
            "builds": rows, "disk_write_bytes_per_s": disk,
            "archives": archives, "images": len(img_files), "text_files": len(txt_files), "text_mb": args.text_mb,
            "short_build_s": SHORT_BUILD_S}


def _linked(raw: Path, copies: int, real: bool = False) -> Path:
    """RAW with each file there `copies` times (hard links where the file system has them, as
    `K-name` beside it; `real`: copies of their own): a build of many files without the minutes
    of making them, enough to keep 16 and more workers busy past their start-up. The decode of a
    copy is the decode of the file."""
    if copies <= 1:
        return raw
    tag = f"{'c' if real else 'x'}{copies}"
    out, stamp = raw.with_name(f"{raw.name}-{tag}"), raw.with_name(f"{raw.name}-{tag}.json")
    files = sorted(p for p in raw.rglob("*") if p.is_file())
    made_for = {"files": [str(f.relative_to(raw)) for f in files], "copies": copies, "real": real}
    if stamp.exists() and out.exists() and json.loads(stamp.read_text()) == made_for:
        return out
    shutil.rmtree(out, ignore_errors=True)
    for f in files:
        (out / f.relative_to(raw)).parent.mkdir(parents=True, exist_ok=True)
        for k in range(copies):
            (shutil.copyfile if real else link_or_copy)(f, out / f.relative_to(raw).parent / f"{k}-{f.name}")
    stamp.write_text(json.dumps(made_for))
    return out


def _bytes_under(raw: Path) -> int:
    """The bytes of every file under RAW, links to folders followed (a manifest's images)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(raw, followlinks=True) for f in names)


def _token_count(out: Path) -> int:
    from packer.dataset.reader import DatasetReader

    reader = DatasetReader(out)
    return sum(int(reader.column(k, "tokens").offsets[-1]) for k in range(len(reader.manifest.shards)))
