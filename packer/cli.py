"""`packer` command line: argparse into BuildConfig, one-line errors, exit codes; no logic.

Exit codes: 0 ok, 1 `verify` / `unpack` found damage, 2 a user error (bad input, options, OUT), 130 ^C.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

from packer import _one_blas_thread  # noqa: F401  first: before numpy is imported
import numpy as np

from packer.dataset import format as fmt
from packer.builder.config import BuildConfig, parse_part, parse_shard_size
from packer.builder.publish import commit
from packer.builder.run import build, build_part
from packer.errors import ConfigError, IntegrityError, MmpackError
from packer.builder.plan import SIZES_SAMPLE, size_report
from packer.dataset.reader import DatasetReader
from packer.builder.scan import scan
from packer.builder.text import MAX_DOC_BYTES
from packer.dataset.verify import verify

SKIPS_SHOWN = 10
CLASSES_SHOWN = 5
# From this share of the workers' time spent waiting on writes (and fsyncs), the build's summary
# says so: the disk, not the cores, is then much of what sets the pace.
DISK_BOUND = 0.25


def show_progress() -> bool:
    """Bars only for a person at a terminal: not under CI, not into a pipe or file."""
    return sys.stderr.isatty() and not os.environ.get("CI")


class ProgressBar:
    """Progress of `unit`s: a tqdm bar (rate, ETA) on a terminal; a plain line every
    LINE_EVERY_S seconds into a pipe or log; nothing under CI or when disabled (--quiet)."""

    LINE_EVERY_S = 30.0

    def __init__(self, desc: str, enabled: bool, unit: str = "rec"):
        self.desc, self.unit, self.bar = desc, unit, None
        self.mode = "off" if not enabled or os.environ.get("CI") else ("bar" if show_progress() else "lines")
        self.started = self.last_line = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if self.mode == "bar":
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, dynamic_ncols=True, leave=False)
            self.bar.update(done - self.bar.n)
        elif self.mode == "lines" and time.monotonic() - self.last_line >= self.LINE_EVERY_S:
            self.last_line = now = time.monotonic()
            rate = done / max(now - self.started, 1e-9)
            eta = (total - done) / rate if rate else float("inf")
            print(f"{self.desc}: {done:,}/{total:,} {self.unit} ({rate:,.0f}/s, ETA {eta:,.0f} s)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="packer", description="Pack raw images and text into memory-mapped shards.")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build a dataset dir from RAW")
    b.add_argument("raw", type=Path, help="input folder")
    b.add_argument("out", help="dataset dir to create, or s3://BUCKET/PREFIX (built in a local cache, then pushed)")
    b.add_argument("--zstd", type=int, nargs="?", const=3, default=None, metavar="LEVEL",
                   help="with a URL for OUT: push it zstd-compressed, as packer push --zstd")
    b.add_argument("--kind", choices=fmt.KINDS, help="force the layout instead of detecting it")
    b.add_argument("--image-size", default="224", help="shorter side resized to S, centre-cropped SxS; 'keep' for own sizes")
    b.add_argument("--keep-aspect", action="store_true",
                   help="with --image-size S: the whole image, shorter side S, no centre crop (for training-time crops)")
    b.add_argument("--max-side", type=int, default=None, metavar="N",
                   help="with --keep-aspect: the longer side at most N (default 2 x S; the image shrinks to fit)")
    b.add_argument("--background", default=None, metavar="R,G,B",
                   help="composite transparent images over this colour (default: alpha dropped, as Pillow's convert)")
    b.add_argument("--tokenizer", type=Path, help="Hugging Face tokenizer.json (required for text and pairs)")
    b.add_argument("--text-key", default="text", help="JSONL key / Parquet column holding the text")
    b.add_argument("--max-doc-bytes", type=int, default=MAX_DOC_BYTES, metavar="N",
                   help=f"skip a longer document: a .txt file, JSONL line or caption (default {MAX_DOC_BYTES >> 20} MiB)")
    b.add_argument("--append-eos", nargs="?", const="auto", default=None, metavar="ID",
                   help="append the tokenizer's end token (or token ID) to each document")
    b.add_argument("--special-tokens", action="store_true", help="let the tokenizer add its special tokens ([CLS] ...)")
    b.add_argument("--shard-size", default="256MB", help="rows per shard (1000) or bytes (256MB); default 256MB")
    b.add_argument("--overwrite", action="store_true", help="rebuild over an existing dataset dir")
    b.add_argument("--strict", action="store_true", help="fail the build on any skipped record")
    b.add_argument("--max-skipped", type=float, default=None, metavar="FRACTION",
                   help="fail the build when more than this fraction of the records found are skipped (e.g. 0.05)")
    b.add_argument("--workers", type=int, default=None, help="worker processes (default: every core)")
    b.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="run shards here (a process pool) or as Ray tasks")
    b.add_argument("--ray-address", default=None, help="Ray cluster to join (default: a local one)")
    b.add_argument("--part", default=None, metavar="i/N",
                   help="build only part i (0-based) of N into a shared OUT; then 'packer commit OUT'")
    b.add_argument("--append", action="store_true", help="add RAW's new records to the dataset in OUT as new shards")
    b.add_argument("--allow-changed", action="store_true",
                   help="with --append: keep the samples of RAW files deleted or changed since the build (refused otherwise)")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress, no skip list")

    c = sub.add_parser("commit", help="publish a build made of --part runs once every shard is there")
    c.add_argument("out", type=Path)
    c.add_argument("--max-skipped", type=float, default=None, metavar="FRACTION",
                   help="refuse to publish when more than this fraction of the records found were skipped")

    m = sub.add_parser("merge", help="join datasets with the same schema into OUT (no re-encoding)")
    m.add_argument("inputs", type=Path, nargs="+", metavar="DATASET", help="two or more dataset dirs")
    m.add_argument("out", type=Path)
    m.add_argument("--overwrite", action="store_true")
    m.add_argument("--allow-duplicate-keys", action="store_true",
                   help="merge even when a key is in more than one input (those samples are then in OUT twice)")

    pk = sub.add_parser("pack", help="write a zstd archive of a dataset dir")
    pk.add_argument("out", type=Path, help="dataset dir")
    pk.add_argument("archive", type=Path, help="archive dir to create")
    pk.add_argument("--level", type=int, default=3, help="zstd level 1..22 (default 3)")
    pk.add_argument("--threads", type=int, default=None, help="compression threads (default: every core)")
    pk.add_argument("--overwrite", action="store_true")

    up = sub.add_parser("unpack", help="restore a dataset dir from a zstd archive, verifying it")
    up.add_argument("archive", type=Path)
    up.add_argument("out", type=Path)
    up.add_argument("--threads", type=int, default=None)
    up.add_argument("--overwrite", action="store_true")

    sz = sub.add_parser("sizes", help="what RAW's images would take on disk under each --image-size policy")
    sz.add_argument("raw", type=Path)
    sz.add_argument("--image-size", type=int, default=256, metavar="S", help="the S to compare at (default 256)")
    sz.add_argument("--max-side", type=int, default=None, metavar="N", help="keep-aspect cap (default 2 x S)")
    sz.add_argument("--kind", choices=fmt.KINDS, help="force the layout instead of detecting it")
    sz.add_argument("--sample", type=int, default=SIZES_SAMPLE, metavar="K",
                    help=f"read the headers of K images spread over RAW and scale up (default {SIZES_SAMPLE}; 0: all)")
    sz.add_argument("--json", action="store_true", help="print the figures as JSON")

    ps = sub.add_parser("push", help="upload a dataset dir to object storage (s3://BUCKET/PREFIX), the manifest last")
    ps.add_argument("out", type=Path, help="a dataset dir, or an archive dir (packer pack's): its zstd files pushed")
    ps.add_argument("url")
    ps.add_argument("--zstd", type=int, nargs="?", const=3, default=None, metavar="LEVEL",
                    help="push it zstd-compressed (level 3 unless given): fewer bytes over the link, decompressed "
                         "into each reader's cache")

    pl = sub.add_parser("pull", help="download a dataset from object storage, every file verified")
    pl.add_argument("url")
    pl.add_argument("out", type=Path)

    i = sub.add_parser("info", help="describe a dataset dir (or archive, or s3:// URL)")
    i.add_argument("out", type=_local_or_url)
    i.add_argument("--json", action="store_true", help="print the figures as JSON")
    i.add_argument("--skipped", action="store_true", help="list every skipped record with its reason")

    v = sub.add_parser("verify", help="re-hash and check every file of a dataset dir (or archive, or s3:// URL)")
    v.add_argument("out", type=_local_or_url)
    return p


def _config(args: argparse.Namespace) -> BuildConfig:
    if args.image_size == "keep":
        size = None
    else:
        try:
            size = int(args.image_size)
        except ValueError:
            raise ConfigError(f"--image-size: {args.image_size!r} is neither a number nor 'keep'") from None
    rows, nbytes = parse_shard_size(args.shard_size)
    background = None
    if args.background is not None:
        try:
            background = tuple(int(v) for v in args.background.split(","))
        except ValueError:
            raise ConfigError(f"--background: {args.background!r} is not R,G,B (e.g. 255,255,255)") from None
    same = {f.name: getattr(args, f.name) for f in fields(BuildConfig) if hasattr(args, f.name)}  # flag = field
    return BuildConfig(**{**same, "out": _build_dir(args), "image_size": size, "shard_rows": rows, "shard_bytes": nbytes,
                          "background": background, "part": parse_part(args.part) if args.part else None})


def _build_dir(args) -> Path:
    """OUT, or for an s3:// URL the local dir the build runs in (kept: the same command run
    again after a kill resumes there), pushed once the build is published."""
    from packer.dataset.remote import build_dir, is_url

    if not is_url(args.out):
        return Path(args.out)
    if args.append or args.part:
        raise ConfigError(f"{args.out}: --append and --part build into a local dir; pull the dataset, build there, "
                          "then packer push")
    return build_dir(args.out)


def _cmd_build(args) -> int:
    config = _config(args)
    if args.zstd is not None and str(args.out) == str(config.out):
        raise ConfigError(f"{args.out}: --zstd compresses what a build pushes to a URL; for a local dataset, "
                          "packer pack it")
    bar = ProgressBar("packing", enabled=not args.quiet, unit="records")
    started = time.perf_counter()
    try:
        if config.part is not None:
            report = build_part(config, on_progress=bar)
        else:
            manifest = build(config, on_progress=bar)
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    if config.part is not None:
        i, n = config.part
        print(f"part {i}/{n}: {report.shards} of {report.total_shards} shards ({report.built} built, "
              f"{report.reused} reused), {report.items:,} records in {seconds:.1f} s; "
              f"run 'packer commit {config.out}' once all {n} parts are done")
        return 0
    _summary(manifest, config.out, seconds, quiet=args.quiet, appended=config.append)
    if str(args.out) != str(config.out):  # a URL: the built dataset goes there
        from packer.dataset.remote import push

        push(config.out, args.out, zstd=args.zstd)
        print(f"pushed -> {args.out}{' zstd-compressed' if args.zstd is not None else ''} (built in {config.out})")
    return 0


def _summary(manifest: fmt.Manifest, out: Path, seconds: float, *, quiet: bool, appended: bool = False) -> None:
    c = manifest.counts
    new = manifest.build.get("appended", [{}])[-1] if appended else c
    skips = manifest.skipped[len(manifest.skipped) - new.get("skipped", 0):] if appended else manifest.skipped
    if not quiet:
        for skip in skips[:SKIPS_SHOWN]:
            print(f"skipped {skip.key}: {skip.reason}")
        if len(skips) > SKIPS_SHOWN:
            print(f"... and {len(skips) - SKIPS_SHOWN} more (packer info {out} --skipped)")
    rate = f"{new.get('packed', 0) / max(seconds, 1e-9):,.0f} samples/s"
    if not appended:
        rate += f", {manifest.size_bytes / max(seconds, 1e-9) / 1e6:,.0f} MB/s written"
        waited = manifest.build.get("disk_wait")
        if waited is not None and waited >= DISK_BOUND:  # the cores were not what set the pace
            rate += f"; the workers spent {100 * waited:.0f}% of their time waiting on the disk"
    if not quiet and manifest.build.get("layout") and not appended:
        print(f"layout {manifest.build['layout']}")
    empty = empty_classes(DatasetReader(out)) if manifest.classes is not None else []
    if empty:
        print(_empty_classes_line(empty, len(manifest.classes)))
    if appended:
        print(f"appended {new.get('found', 0):,} new records = packed {new.get('packed', 0):,} + skipped "
              f"{new.get('skipped', 0):,} in {seconds:.1f} s ({rate}); {out} now holds found {c['found']:,} = "
              f"packed {c['packed']:,} + skipped {c['skipped']:,} in {len(manifest.shards)} shards, "
              f"{_human_bytes(manifest.size_bytes)}")
        return
    print(
        f"found {c['found']} = packed {c['packed']} + skipped {c['skipped']}; "
        f"{len(manifest.shards)} shards, {_human_bytes(manifest.size_bytes)} in {seconds:.1f} s "
        f"({rate}) -> {out}"
    )


def _cmd_commit(args) -> int:
    started = time.perf_counter()
    manifest = commit(args.out, max_skipped=args.max_skipped)
    _summary(manifest, args.out, time.perf_counter() - started, quiet=True)
    return 0


def _cmd_sizes(args) -> int:
    size, cap = args.image_size, args.max_side or 2 * args.image_size
    if not 1 <= size <= cap:
        raise ConfigError(f"--image-size {size} and --max-side {cap}: need 1 <= S <= N")
    found = scan(args.raw, args.kind)
    if found.kind == "text":
        raise ConfigError(f"{args.raw}: holds text ({found.why}); 'packer sizes' compares image storage")
    bar = ProgressBar("reading headers", enabled=not args.json, unit="images")
    try:
        report = size_report(found, size, cap, sample=args.sample or None, on_progress=bar)
    finally:
        bar.close()
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    n, read = report["records"], report["headers_read"]
    print(f"{args.raw}: {n:,} images; sizes from the headers of {read:,}"
          + (" (all)" if read == n else " spread over RAW, scaled up") + "; no pixel decoded")
    rows = [(f"--image-size {size}", f"{size} x {size} centre crops", "fixed"),
            (f"--image-size {size} --keep-aspect", f"shorter side {size}, longer <= {cap}", "keep_aspect"),
            ("--image-size keep", "each image at its own size", "keep"),
            ("(the source files)", "JPEG, PNG ... as they are", "source")]
    for flag, what, key in rows:
        b = report["bytes"][key]
        print(f"  {flag:<36} {what:<36} {_human_bytes(b):>10}  {b / max(n, 1):>12,.0f} B/image")
    if report["unreadable"]:
        print(f"  ({report['unreadable']:,} of those headers unreadable: the build would skip them)")
    return 0


def empty_classes(reader: DatasetReader) -> list[str]:
    """The classes no packed sample has (an empty folder, or only files that were skipped)."""
    counts = reader.class_counts()
    return [] if counts is None else [reader.manifest.classes[i] for i in np.flatnonzero(counts == 0)]


def _empty_classes_line(empty: list[str], total: int) -> str:
    shown = ", ".join(empty[:CLASSES_SHOWN]) + (", ..." if len(empty) > CLASSES_SHOWN else "")
    return (f"{len(empty)} of {total} classes have no packed image: {shown} (their labels are kept, "
            "as torchvision's ImageFolder numbers them)")


def info_dict(root: Path) -> dict:
    """What `packer info` says of a dataset dir, or of an archive (from its description: the
    classes no sample has are not known without unpacking its labels)."""
    from packer.dataset.archive import is_archive, read_archive

    archived = is_archive(root)
    if archived:
        m, files = read_archive(root)
        reader, extra = None, {"archive_bytes": sum(f.size_bytes for f in files)}
    else:
        reader, extra = DatasetReader(root), {}
        m = reader.manifest
    return {
        "path": str(root),
        "format": f"{fmt.FORMAT_NAME} {m.version}" + (" (zstd archive)" if archived else ""),
        "kind": m.kind,
        "num_samples": m.num_samples,
        "num_shards": len(m.shards),
        "size_bytes": m.size_bytes,
        "columns": {c.name: {"dtype": c.dtype, "shape": list(c.shape), "ragged": c.ragged} for c in m.columns},
        "classes": list(m.classes) if m.classes is not None else None,
        "empty_classes": empty_classes(reader) if reader is not None else None,
        "counts": m.counts,
        "tokenizer": m.tokenizer,
        "images": _image_policy(m),
        "skipped": [{"key": k.key, "stage": k.stage, "reason": k.reason} for k in m.skipped],
        **extra,
    }


def _image_policy(m: fmt.Manifest) -> str | None:
    """How the build sized its images, in the flags' words (None: no image column)."""
    if not any(c.name == "image" for c in m.columns) or "image_size" not in m.build:
        return None  # no images, or a build that did not record how (a merge)
    size, cap = m.build.get("image_size"), m.build.get("max_side")
    if size is None:
        return "--image-size keep: each image at its own size"
    if cap:
        return f"--image-size {size} --keep-aspect: whole images, shorter side {size}, longer <= {cap}"
    return f"--image-size {size}: {size} x {size} centre crops"


def _cmd_info(args) -> int:
    d = info_dict(args.out)
    skipped = d.pop("skipped")
    if args.json:
        if args.skipped:
            d["skipped"] = skipped
        print(json.dumps(d, indent=1))
        return 0
    cols = "; ".join(f"{n} {c['dtype']} {tuple(c['shape'])}" for n, c in d["columns"].items())
    print(f"dataset   {d['path']} ({d['format']}, kind {d['kind']})")
    packed = f" ({_human_bytes(d['archive_bytes'])} compressed)" if "archive_bytes" in d else ""
    print(f"samples   {d['num_samples']:,} in {d['num_shards']} shards, {_human_bytes(d['size_bytes'])}{packed}")
    print(f"columns   {cols}")
    if d["images"]:
        print(f"images    {d['images']}")
    if d["classes"] is not None:
        shown = ", ".join(d["classes"][:10]) + (" ..." if len(d["classes"]) > 10 else "")
        print(f"classes   {len(d['classes'])}: {shown}")
        if d["empty_classes"]:
            print(f"          {_empty_classes_line(d['empty_classes'], len(d['classes']))}")
    if d["tokenizer"]:
        t = d["tokenizer"]
        print(f"tokenizer {t['path']} (sha256 {t['sha256'][:12]}, vocab {t['vocab_size']:,}, {t['dtype']}, eos {t['eos_id']})")
    c = d["counts"]
    print(f"records   found {c['found']:,} = packed {c['packed']:,} + skipped {c['skipped']:,}")
    if args.skipped:
        for skip in skipped:
            print(f"skipped   {skip['key']} [{skip['stage']}]: {skip['reason']}")
    return 0


def _cmd_verify(args) -> int:
    from packer.dataset.archive import is_archive, verify_archive

    bar = ProgressBar("verifying", enabled=True)
    try:
        result = (verify_archive if is_archive(args.out) else verify)(args.out, on_progress=bar)
    except IntegrityError as exc:
        bar.close()
        print(f"packer verify: FAILED: {exc}", file=sys.stderr)
        return 1
    bar.close()
    print(f"ok: {result['files']} files, {_human_bytes(result['size_bytes'])}, {result['num_samples']:,} samples verified")
    return 0


def _cmd_merge(args) -> int:
    from packer.merge import merge

    if len(args.inputs) < 2:
        raise ConfigError("merge: give at least two dataset dirs, then OUT")
    started = time.perf_counter()
    manifest = merge(args.inputs, args.out, overwrite=args.overwrite, allow_duplicate_keys=args.allow_duplicate_keys)
    print(f"merged {len(args.inputs)} datasets: {manifest.num_samples:,} samples in {len(manifest.shards)} shards, "
          f"{_human_bytes(manifest.size_bytes)} in {time.perf_counter() - started:.1f} s -> {args.out}")
    return 0


def _transfer_line(verb: str, t, dest: Path) -> str:
    return (f"{verb} {_human_bytes(t.raw_bytes)} <-> {_human_bytes(t.packed_bytes)} zstd (ratio {t.ratio:.2f}x) "
            f"in {t.seconds:.1f} s ({t.mb_per_s:,.0f} MB/s of raw data) -> {dest}")


def _cmd_pack(args) -> int:
    from packer.dataset.archive import pack

    print(_transfer_line("packed", pack(args.out, args.archive, level=args.level, threads=args.threads,
                                        overwrite=args.overwrite), args.archive))
    return 0


def _cmd_unpack(args) -> int:
    from packer.dataset.archive import unpack

    try:
        t = unpack(args.archive, args.out, threads=args.threads, overwrite=args.overwrite)
    except IntegrityError as exc:
        print(f"packer unpack: FAILED: {exc}", file=sys.stderr)
        return 1
    print(_transfer_line("unpacked and verified", t, args.out))
    return 0


def _local_or_url(text: str):
    """A dataset dir or archive as a Path; an s3:// URL as the local copy in the node's cache
    (downloaded and verified once)."""
    from packer.dataset.remote import is_url, materialize

    return materialize(text) if is_url(text) else Path(text)


def _cmd_push(args) -> int:
    from packer.dataset.remote import push

    m = push(args.out, args.url, zstd=args.zstd)
    samples, size = sum(s.num_samples for s in m.shards), sum(s.size_bytes for s in m.shards)
    last = "zstd-compressed, archive.json last" if args.zstd is not None or (args.out / "archive.json").is_file() \
        else "the manifest last"
    print(f"pushed {args.out} -> {args.url}: {samples:,} samples, {_human_bytes(size)}, {last}")
    return 0


def _cmd_pull(args) -> int:
    from packer.dataset import format as fmt
    from packer.dataset.outdir import check_out
    from packer.dataset.remote import pull, read_published

    published = read_published(args.url)
    m = published[0]
    mine = Path(args.out) / fmt.MANIFEST_NAME
    if mine.is_file() and fmt.Manifest.from_json(mine.read_text(encoding="utf-8"), where=str(mine)) == m:
        print(f"{args.out} holds {args.url} already (run 'packer verify {args.out}' to re-hash it)")
        return 0
    check_out(args.out, append=False, overwrite=False)
    m = pull(args.url, args.out, published=published)
    print(f"pulled {args.url} -> {args.out}: {sum(s.num_samples for s in m.shards):,} samples, every file verified")
    return 0


COMMANDS = {"build": _cmd_build, "commit": _cmd_commit, "sizes": _cmd_sizes, "info": _cmd_info, "verify": _cmd_verify,
            "merge": _cmd_merge, "pack": _cmd_pack, "unpack": _cmd_unpack, "push": _cmd_push, "pull": _cmd_pull}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's: that is where the typo is
        parser._subparsers._group_actions[0].choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # `packer info OUT | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # 128 + SIGPIPE, what a shell reports for a program its pipe stopped
    except MmpackError as exc:
        print(f"packer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # disk full, permissions: the environment, not a bug
        where = f"{exc.filename}: " if exc.filename else ""
        hint = ""
        if exc.errno == errno.ENOSPC and args.command == "build":
            hint = (f"; no dataset was published, whole shards stay in {_build_dir(args) / fmt.STAGING_DIR}: free "
                    "space and run the same command to resume, or delete it")
        print(f"packer {args.command}: error: {where}{exc.strerror or exc}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = ("; whole shards are kept: run the same command again to go on"
                if args.command == "build" else "")
        print(f"packer {args.command}: interrupted{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
