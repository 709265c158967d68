"""`bench loaders`: every system on the same data in one run, against the machine's memcpy
bandwidth measured in the same run. `bench sweep` is in sweep_bench.py."""

from __future__ import annotations

import os
import platform
import sys
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import data, peers
from .peers import MP_CONTEXT
from .doctor import stall
from .measure import MachineLoad, MemcpyLimit, dir_bytes, files_under, first_pass_rate, measure, steady_batch_s
from .prepare import prepare_dataset, prepare_image_thirds, prepare_images, prepare_text

PIN = torch.cuda.is_available()  # pin_memory=True without CUDA only warns


class OnTheFlyImages(torch.utils.data.Dataset):
    """The baseline users have today: an ImageFolder-style Dataset decoding in workers."""

    def __init__(self, files, labels, size):
        self.files, self.labels, self.size = files, labels, size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from packer.builder.images import decode_image

        return {"image": torch.from_numpy(decode_image(self.files[i], self.size)), "label": self.labels[i]}


class OnTheFlyText(torch.utils.data.Dataset):
    """The text baseline: raw documents tokenized in DataLoader workers."""

    def __init__(self, texts: list[str], tokenizer: Path):
        self.texts, self.tokenizer, self._tok = texts, str(tokenizer), None

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        if self._tok is None:
            from packer.builder.text import load_tokenizer

            self._tok = load_tokenizer(self.tokenizer)
        return torch.tensor(self._tok.encode(self.texts[i], add_special_tokens=False).ids, dtype=torch.int64)


def hand_rolled_windows(path: Path, dtype, seq_len: int, batch: int, batches: int, seed: int = 0):
    """The batch gather of nanoGPT's train.py, at its fastest: random window starts in one flat
    memmap of token ids, sorted, one fancy index per batch; (x, y) views as stored (uint16 for
    GPT-2's vocabulary; the model widens them on the device)."""
    data = np.memmap(path, dtype=dtype, mode="r")
    rng = np.random.default_rng(seed)
    span = np.arange(seq_len + 1)
    for _ in range(batches):
        ix = np.sort(rng.integers(0, len(data) - seq_len - 1, batch))
        w = torch.from_numpy(data[ix[:, None] + span])
        yield w[:, :-1], w[:, 1:]


def machine() -> dict:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    return {"cores": os.cpu_count(), "ram_gib": round(mem, 1), "python": platform.python_version(),
            "torch": torch.__version__, "numpy": np.__version__, "cuda": torch.cuda.is_available(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "platform": platform.platform()}


@dataclass(frozen=True)
class _Images:
    """The photo crops every image row reads: the raw files and their labels (the baselines and
    peers read them), the mmpack build of them and what making each cost."""

    work: Path
    raw: Path
    ds: Any  # MMapDataset of the build, columns image and label
    files: list[Path]  # the build's files (evicted with --cold)
    raw_files: list[Path]
    labels: list[int]
    conv: dict  # mmpack's conversion: build seconds, bytes on disk
    raw_conv: dict
    on_the_fly_limit: int  # samples a pass of a decoding baseline reads


def _images(args, work: Path) -> _Images:
    from loaders import MMapDataset

    raw, out, build_s = prepare_images(work, args.images)
    ds = MMapDataset(out, columns=["image", "label"])
    raw_files = sorted(p for p in raw.rglob("*") if p.is_file())
    classes = sorted({p.parent.name for p in raw_files})
    return _Images(work=work, raw=raw, ds=ds, files=[ds.reader.root / f.path for s in ds.manifest.shards for f in s.files],
                   raw_files=raw_files, labels=[classes.index(p.parent.name) for p in raw_files],
                   conv={"convert_s": build_s, "disk_bytes": dir_bytes(out)},
                   raw_conv={"convert_s": 0.0, "disk_bytes": sum(p.stat().st_size for p in raw_files)},
                   on_the_fly_limit=min(len(raw_files), 4 * args.batch_size))


class _Rows:
    """The rows of one `bench loaders` run, in the order measured: each with the memcpy of its
    thread count measured again before it, a system that breaks is a row with its error, and each
    row is said on stderr when it is done."""

    def __init__(self, args, sample_bytes: int):
        self.args, self.sample_bytes = args, sample_bytes
        self.memcpy = MemcpyLimit(args.batch_size * sample_bytes)  # by thread count, measured again before each row
        self.results: list[dict] = []
        self.model = self.resident = None  # with --model: (device, image step, token step), the step's own rate

    def run(self, name, family, make_iter, count_of, conversion, cold_files, limit=None, kind="images",
            n_passes=None, threads=None) -> dict:
        """One row: `n_passes` timed passes (default --passes) on `threads` (default the DataLoader's
        workers, at least 1), and with --step-ms or --model a loop with that step."""
        args = self.args
        threads = (min(args.workers, os.cpu_count() or 1) or 1) if threads is None else threads
        r = {"system": name, "family": family, "kind": kind, "threads": threads, **conversion}
        self.memcpy.measure(threads)
        try:
            r.update(measure(make_iter, count_of, passes=args.passes if n_passes is None else n_passes, limit=limit,
                             cold_files=cold_files if args.cold else None))
            if args.step_ms is not None or args.model:
                step = (self.model[1] if kind == "images" else self.model[2]) if args.model else None
                r["stall"] = stall(make_iter(), args.step_ms or 0, steps=args.stall_steps, mode=args.step_mode,
                                   step=step)
                if args.model and kind == "images" and r["stall"]["steps"]:
                    loop = r["stall"]["steps"] * args.batch_size / (r["stall"]["wait_s"] + r["stall"]["step_s"])
                    r["stall"].update(samples_per_s=loop, pct_resident=100 * loop / self.resident)
        except Exception as exc:  # noqa: BLE001 - a system that breaks is a row with its error
            r["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        if "samples_per_s" in r and kind == "images":
            r["mb_per_s"] = r["samples_per_s"] * self.sample_bytes / 1e6
        self.results.append(r)
        _progress(r)
        return r

    def against_memcpy(self) -> None:
        """Each row's rate as a share of the best memcpy of its thread count seen over the whole run."""
        for r in self.results:
            if "samples_per_s" not in r:
                continue
            limit = max(self.memcpy.best.values()) if r.get("best_memcpy") else self.memcpy(r["threads"])
            if r.get("kind") == "tokens":
                r["tokens_per_s"] = r.pop("samples_per_s")
                r["pct_memcpy"] = 100 * r["tokens_per_s"] * r.get("token_bytes", 8) / limit  # bytes of the tokens written
            else:
                r["pct_memcpy"] = 100 * r["samples_per_s"] * self.sample_bytes / limit
            if r.get("steady_batch_s"):
                r["steady_pct_memcpy"] = 100 * self.args.batch_size * self.sample_bytes / r["steady_batch_s"] / limit


def bench_loaders(args) -> dict:
    """The rows in the order they are measured: the Loader's, a Mixture, numpy copies, DataLoaders
    and the on-the-fly baseline, the peers, then tokens; each against memcpy and the baselines."""
    load = MachineLoad()
    work = Path(args.work or tempfile.mkdtemp(prefix="mmpack-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    images = _images(args, work)
    ds = images.ds
    rows = _Rows(args, ds.columns["image"].sample_nbytes)
    if args.model:  # real networks: a ResNet (--arch) for images, a small transformer for tokens
        model_name, rows.model, rows.resident = _model(ds, args.batch_size, getattr(args, "arch", "resnet18"),
                                                       args.stall_steps)
    single = _loader_rows(rows, images)
    _mixture_row(rows, images, single)
    _numpy_copies_row(rows, images)
    _dataloader_rows(rows, images)
    peer_state = _peer_rows(rows, images)
    _token_rows(rows, work)
    rows.against_memcpy()
    results, memcpy, sample_bytes = rows.results, rows.memcpy, rows.sample_bytes
    _ratios(results)
    return {
        "command": "bench loaders", "machine": machine(), "load": load.report(), "memcpy_bytes_per_s": memcpy(1),
        "default_vs_explicit": _default_vs_explicit(results),
        "memcpy_by_threads": {str(k): v for k, v in sorted(memcpy.best.items())},
        "memcpy_images_per_s": memcpy(1) / sample_bytes, "batch_size": args.batch_size, "workers": args.workers,
        "num_images": len(ds), "image_shape": list(ds.columns["image"].shape), "results": results,
        "peers": peer_state, "step_ms": args.step_ms, "step_mode": "model" if args.model else args.step_mode,
        "model": (f"{model_name} (images), a 4-layer transformer (tokens) on {rows.model[0]}") if args.model else None,
        "resident_samples_per_s": rows.resident if args.model else None,
        "cache": ("warm for every rate; cold = one pass right after evicting the system's files from the page "
                  "cache with posix_fadvise(DONTNEED)") if args.cold else "warm (run with --cold for cold passes)",
        "notes": ["conversion for mmpack = packer build from the raw files (decode included); for a peer's "
                  "decoded variant = writing the pixels mmpack decoded (decode not included)"],
    }


def _model(ds, bs: int, arch: str, stall_steps: int) -> tuple[str, tuple, float]:
    """--model: the images' network's name, (device, image step, token step), and the image step's
    own rate on batches already on its device (`_resident_rate`)."""
    from loaders import Loader
    from packer.builder.text import load_tokenizer

    from .models import ARCHS, model_steps

    model = model_steps(load_tokenizer(data.minilm_tokenizer()).get_vocab_size(), 1024, arch)
    with Loader(ds, bs, device=model[0]) as one:
        return ARCHS[arch], model, _resident_rate(one, model[1], stall_steps)


def _loader_rows(rows: _Rows, images: _Images) -> dict:
    """The Loader's rows: one per --threads-list count, its default against the machine's best
    memcpy, the JPEG lane (--jpeg) and the batch put on the GPU (--model on CUDA); the default row."""
    from loaders import Loader

    args, ds, bs, cores = rows.args, images.ds, rows.args.batch_size, os.cpu_count() or 1
    # each Loader row: steady passes of one Loader, and the first pass of fresh ones (a job that
    # makes a Loader per epoch, or runs one short epoch, gets that)
    for threads in sorted(set(getattr(args, "threads_list", None) or {1, cores})):
        loader = Loader(ds, bs, num_threads=threads)
        r = rows.run(f"mmpack Loader, {threads} thread(s)", "mmpack", lambda loader=loader: loader,
                     lambda b: len(b["label"]), images.conv, images.files, threads=threads)
        r["first_pass_samples_per_s"] = first_pass_rate(lambda t=threads: Loader(ds, bs, num_threads=t),
                                                        lambda b: len(b["label"]))
    # its default: a thread count from the machine, against the machine's best memcpy
    for t in sorted({min(2 ** k, cores) for k in range(cores.bit_length() + 1)}):
        rows.memcpy.measure(t)
    loader = Loader(ds, bs)
    single = rows.run("mmpack Loader, default threads", "mmpack", lambda: loader, lambda b: len(b["label"]),
                      images.conv, images.files, threads=cores)
    single.update(threads=loader.num_threads, best_memcpy=True, default=True,
                  system=f"mmpack Loader, default ({loader.num_threads} threads)")
    single["first_pass_samples_per_s"] = first_pass_rate(lambda: Loader(ds, bs), lambda b: len(b["label"]))
    single["steady_batch_s"] = steady_batch_s(loader)  # a long epoch's rate, without each pass's start
    device = rows.model[0] if args.model else None
    if getattr(args, "jpeg", False):
        _jpeg_lane(images.work, images.raw, args.images, bs, single, rows.run, device)
    if args.model and device.type != "cpu":  # the batch put on the GPU by the Loader (copied ahead, side stream)
        rows.run(f"mmpack Loader(device={device.type}), default threads", "mmpack",
                 lambda: Loader(ds, bs, device=device), lambda b: len(b["label"]), images.conv, images.files,
                 threads=loader.num_threads)
    return single


def _mixture_row(rows: _Rows, images: _Images, single: dict) -> None:
    """As many samples from a mixture of the same crops cut in 3 datasets, 5:3:2; with the default
    row (`single`) measured, its rate as a share of one source's, from passes of the two alternated."""
    from loaders import Loader, Mixture, MMapDataset

    ds, bs = images.ds, rows.args.batch_size
    parts = [MMapDataset(out, columns=["image", "label"]) for out in prepare_image_thirds(images.work, rows.args.images)]
    mixture = Mixture(parts, [5, 3, 2], num_samples=len(ds))
    loader = Loader(mixture, bs)
    r = rows.run(f"mmpack Loader over a Mixture of 3 datasets, default ({loader.num_threads} threads)", "mmpack",
                 lambda: loader, lambda b: len(b["label"]), images.conv, images.files, threads=loader.num_threads)
    if "samples_per_s" in r and "samples_per_s" in single:
        from .measure import alternated

        shares = alternated(Loader(ds, bs), loader, rounds=5)
        r.update(of_one_source_pct=100 * statistics.median(shares), of_one_source_range_pct=[100 * min(shares),
                                                                                          100 * max(shares)])


def _numpy_copies_row(rows: _Rows, images: _Images) -> None:
    """The default Loader without its C copies: what an install without a compiler gets (no row
    where the C library is not built)."""
    from loaders import Loader
    from loaders.batch import native

    if native.LIB is None:
        return
    lib, native.LIB = native.LIB, None
    try:
        loader = Loader(images.ds, rows.args.batch_size)
        r = rows.run("mmpack Loader, numpy copies", "mmpack", lambda: loader, lambda b: len(b["label"]), images.conv,
                     images.files, threads=os.cpu_count() or 1)
        r.update(threads=loader.num_threads, best_memcpy=True,
                 system=f"mmpack Loader, default, numpy copies ({loader.num_threads} threads)")
    finally:
        native.LIB = lib


def _dataloader_rows(rows: _Rows, images: _Images) -> None:
    """The rows in --workers DataLoader processes: mmpack's batched view in a StatefulDataLoader,
    MMapDataset with collate, and the on-the-fly baseline decoding the raw files with Pillow."""
    from loaders import StatefulDataLoader

    ds, bs, workers = images.ds, rows.args.batch_size, rows.args.workers
    context = MP_CONTEXT if workers else None
    batched = StatefulDataLoader(ds.batched(bs), num_workers=workers, pin_memory=PIN, multiprocessing_context=context)
    rows.run(f"mmpack batched + StatefulDataLoader({workers} worker processes)", "mmpack", lambda: batched,
             lambda b: len(b["label"]), images.conv, images.files)
    rows.run(f"MMapDataset + DataLoader({workers} workers, collate)", "mmpack",
             lambda: torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=True, num_workers=workers, pin_memory=PIN,
                                                 multiprocessing_context=context),
             lambda b: len(b["label"]), images.conv, images.files)
    otf = OnTheFlyImages(images.raw_files, images.labels, ds.columns["image"].shape[0])
    rows.run(f"on-the-fly Pillow + DataLoader({workers} workers)", "baseline",
             lambda: torch.utils.data.DataLoader(otf, batch_size=bs, shuffle=True, num_workers=workers, pin_memory=PIN,
                                                 multiprocessing_context=context),
             lambda b: len(b["label"]), images.raw_conv, images.raw_files, limit=images.on_the_fly_limit, n_passes=1)


def _peer_rows(rows: _Rows, images: _Images) -> dict:
    """Each peer's systems (bench/peers.py) on the same crops, converted to its format first; a peer
    not installed (or --no-peers) a skipped row. Returns each peer's state: 'ran' or why not."""
    args, bs = rows.args, rows.args.batch_size
    peer_state = {}
    src = peers.Source(images.ds, images.raw_files, images.labels, images.ds.columns["image"].shape[0])
    for module, adapter in peers.ADAPTERS.items():
        reason = "left out (--no-peers)" if getattr(args, "no_peers", False) else peers.availability(module)
        peer_state[module] = reason or "ran"
        if reason:
            rows.results.append({"system": peers.NAMES[module], "family": "peer", "kind": "images", "skipped": reason})
            _progress(rows.results[-1])
            continue
        for system in adapter(src, bs, args.workers):
            target = images.work / "peers" / system.name.split(" +")[0].replace(" ", "-").lower()
            try:
                conv = peers.timed_convert(system, target)
            except Exception as exc:  # noqa: BLE001
                rows.results.append({"system": system.name, "family": "peer", "kind": "images",
                                     "error": f"conversion failed: {type(exc).__name__}: {str(exc)[:160]}"})
                continue
            rows.run(system.name, "peer", lambda s=system, t=target: s.loader(t), system.count_of, conv,
                     files_under(target), limit=images.on_the_fly_limit if system.jpeg else None,
                     n_passes=1 if system.jpeg else args.passes)
    return peer_state


def _token_rows(rows: _Rows, work: Path) -> None:
    """The token rows on --text-mb of real text: TokenWindows and PackedDocuments through the Loader,
    nanoGPT's hand-rolled gather from one flat file, and tokenizing on the fly in DataLoader workers."""
    from loaders import Loader, PackedDocuments, TokenWindows

    workers = rows.args.workers
    text_raw, text_out, text_build_s = prepare_text(work, rows.args.text_mb)
    tw = TokenWindows(text_out, 1024)
    tloader = Loader(tw, 32)
    rows.run("mmpack TokenWindows(1024) via Loader", "mmpack", lambda: tloader, lambda b: b[0].numel(),
             {"convert_s": text_build_s, "disk_bytes": dir_bytes(text_out)}, files_under(text_out), kind="tokens")
    flat = work / "tokens-1024.bin"  # nanoGPT's train.bin: the same token stream as one flat file, as stored
    stream = np.concatenate([tw._reader.column(k, "tokens").values for k in range(len(tw._reader.manifest.shards))])
    stream.tofile(flat)
    r = rows.run(f"hand-rolled memmap gather (nanoGPT: sorted fancy index, {stream.dtype.name})", "peer",
                 lambda: hand_rolled_windows(flat, stream.dtype, 1024, 32, len(tw) // 32), lambda b: b[0].numel(),
                 {"convert_s": text_build_s, "disk_bytes": flat.stat().st_size}, [flat], kind="tokens")
    r["token_bytes"] = stream.dtype.itemsize  # it leaves the widening to int64 to the model's device
    pdocs = Loader(PackedDocuments(text_out, 2048), 8)
    rows.run("mmpack PackedDocuments(2048) via Loader", "mmpack", lambda: pdocs, lambda b: b["tokens"].numel(),
             {"convert_s": text_build_s, "disk_bytes": dir_bytes(text_out)}, files_under(text_out), kind="tokens")
    texts = [p.read_text(encoding="utf-8") for p in sorted(text_raw.rglob("*.txt"))]
    otf_text = OnTheFlyText(texts, data.minilm_tokenizer())
    rows.run(f"on-the-fly tokenizers + DataLoader({workers} workers)", "baseline",
             lambda: torch.utils.data.DataLoader(otf_text, batch_size=8, shuffle=True, num_workers=workers,
                                                 collate_fn=torch.cat,
                                                 multiprocessing_context=MP_CONTEXT if workers else None),
             lambda b: b.numel(), {"convert_s": 0.0, "disk_bytes": sum(len(t.encode()) for t in texts)},
             files_under(text_raw), kind="tokens", n_passes=1)


def _jpeg_lane(work: Path, raw: Path, count: int, bs: int, pixels: dict, run, device=None) -> None:
    """--jpeg: the same crops built with --store jpeg, read by the Loader at its default threads
    (Pillow decoding in them): images/s, bytes on disk per image and CPU per 1000 images, beside
    the pixel lane's default row (`pixels`); on a CUDA `device` (--model) also decoded there
    (nvJPEG, where torchvision has it)."""
    from loaders import Loader, MMapDataset

    _, out, seconds = prepare_dataset(work, "images-jpeg", count,
                                      lambda dst: shutil.copytree(raw, dst, copy_function=os.link), {"store": "jpeg"})
    ds = MMapDataset(out, columns=["image", "label"])
    loader = Loader(ds, bs)
    disk = dir_bytes(out)
    r = run(f"mmpack Loader, JPEG lane, q90, default ({loader.num_threads} threads)", "mmpack",
            lambda: loader, lambda b: len(b["label"]), {"convert_s": seconds, "disk_bytes": disk}, files_under(out),
            threads=loader.num_threads)
    pixels.update(lane="pixels", bytes_per_image=pixels["disk_bytes"] / len(ds))
    r.update(lane="jpeg", bytes_per_image=disk / len(ds), best_memcpy=True)
    if "samples_per_s" in r and "samples_per_s" in pixels:
        r.update(of_pixel_lane_pct=100 * r["samples_per_s"] / pixels["samples_per_s"],
                 bytes_of_pixel_lane_pct=100 * disk / pixels["disk_bytes"])
    if device is not None and device.type == "cuda":
        on = Loader(ds, bs, device=device)
        run(f"mmpack Loader(device={device.type}), JPEG lane: {'nvJPEG' if on._decode else 'Pillow (no torchvision)'}",
            "mmpack", lambda: on, lambda b: len(b["label"]), {"convert_s": seconds, "disk_bytes": disk},
            files_under(out), threads=on.num_threads)["lane"] = "jpeg, device decode"


def _default_vs_explicit(results: list[dict]) -> dict | None:
    """The default Loader against the best explicit thread count of this run, first pass of a
    fresh Loader against first pass, steady against steady; and how much of its steady rate a
    fresh Loader's first pass reaches (its ring is allocated and faulted in during that pass)."""
    default = next((r for r in results if r.get("default") and "samples_per_s" in r), None)
    explicit = [r for r in results if r["system"].startswith("mmpack Loader, ") and "thread(s)" in r["system"]
                and "samples_per_s" in r]
    if default is None or not explicit:
        return None
    best = max(explicit, key=lambda r: r["samples_per_s"])
    return {"best_explicit": best["system"], "best_explicit_samples_per_s": best["samples_per_s"],
            "default_first_pass_pct": 100 * default["first_pass_samples_per_s"] / best["first_pass_samples_per_s"],
            "default_steady_pct": 100 * default["samples_per_s"] / best["samples_per_s"],
            "first_pass_of_steady_pct": 100 * default["first_pass_samples_per_s"] / default["samples_per_s"]}


def _ratios(results: list[dict]) -> None:
    base = next((r["samples_per_s"] for r in results if r.get("family") == "baseline" and r["kind"] == "images"
                 and "samples_per_s" in r), None)
    collate = next((r["samples_per_s"] for r in results if r["system"].startswith("MMapDataset")
                    and "samples_per_s" in r), None)
    tbase = next((r["tokens_per_s"] for r in results if r.get("family") == "baseline" and r["kind"] == "tokens"
                  and "tokens_per_s" in r), None)
    for r in results:
        if r.get("kind") == "images" and "samples_per_s" in r:
            if base:
                r["x_on_the_fly"] = r["samples_per_s"] / base
            if collate:
                r["x_dataloader_collate"] = r["samples_per_s"] / collate
        if r.get("kind") == "tokens" and "tokens_per_s" in r and tbase:
            r["x_on_the_fly"] = r["tokens_per_s"] / tbase


def _resident_rate(loader, step, steps: int) -> float:
    """Images/s of the model step alone: one batch, already on the model's device, trained on
    again and again (the ceiling of any loader feeding that model)."""
    batch = next(iter(loader))
    for _ in range(2):  # warm-up: kernels chosen, memory allocated
        step(batch)
    steps = max(steps or 10, 3)
    started = time.perf_counter()
    for _ in range(steps):
        step(batch)  # each step synchronises
    return steps * len(batch["label"]) / (time.perf_counter() - started)


def _progress(r: dict) -> None:
    state = r.get("skipped") or r.get("error") or f"{r.get('samples_per_s', 0):,.0f}/s"
    print(f"  measured {r['system']}: {state}", file=sys.stderr, flush=True)
