"""`packer` command line: flags parsed into the calls of `packer.api`, what they return printed,
errors as one line, exit codes; no logic of its own.

Exit codes: 0 ok, 1 `verify` / `unpack` found damage, 2 a user error (bad input, options, OUT), 130 ^C.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from pathlib import Path

from packer import api
from packer.remote import is_url as remote_url
from packer.builder.plan import JPEG_SAMPLE, SIZES_SAMPLE
from packer.builder.config import BuildConfig
from packer.dataset import format as fmt
from packer.dataset.reader import DatasetReader
from packer.errors import IntegrityError, MmpackError
from packer.progress import ProgressBar, human_bytes

SKIPS_SHOWN = 10
CLASSES_SHOWN = 5
# From this share of the workers' time spent waiting on writes (and fsyncs), the build's summary
# says so: the disk, not the cores, is then much of what sets the pace.
DISK_BOUND = 0.25


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="packer", description="Pack raw images and text into memory-mapped shards.")
    sub = p.add_subparsers(dest="command", required=True)
    _build_parser(sub.add_parser("build", help="build a dataset dir from RAW", argument_default=argparse.SUPPRESS))

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
    i.add_argument("out", help="a dataset dir, archive or URL")
    i.add_argument("--json", action="store_true", help="print the figures as JSON")
    i.add_argument("--skipped", action="store_true", help="list every skipped record with its reason")

    sh = sub.add_parser("show", help="a few samples as the model will see them: key, class, caption or transcript "
                                     "(decoded), image size or clip length; --png draws them")
    sh.add_argument("out", help="a dataset dir, archive or URL")
    sh.add_argument("-n", type=int, default=16, help="samples, spread evenly over the dataset (default 16)")
    sh.add_argument("--png", type=Path, default=None, metavar="FILE",
                    help="draw them: images in a grid under their class names, clips as waveforms")
    sh.add_argument("--json", action="store_true", help="print the samples as JSON")

    v = sub.add_parser("verify", help="re-hash and check every file of a dataset dir (or archive, or s3:// URL)")
    v.add_argument("out", help="a dataset dir, archive or URL")
    v.add_argument("--cache", nargs="?", const=True, default=False, metavar="DIR",
                   help="a URL's copies in this node's cache (default ~/.cache/mmpack/remote) instead of the store: "
                        "each cached file re-hashed, those that no longer match removed (fetched again when read)")
    return p


def _build_parser(b: argparse.ArgumentParser) -> None:
    """`packer build`'s flags: BuildConfig's, from their declarations, with no defaults of their
    own (SUPPRESS: a flag not given is not passed, so `packer.build`'s default holds)."""
    b.add_argument("raw", type=Path, help="input folder")
    b.add_argument("out", help="dataset dir to create, or s3://BUCKET/PREFIX (built in a local cache, then pushed)")
    b.add_argument("--zstd", type=int, nargs="?", const=3, metavar="LEVEL",
                   help="with a URL for OUT: push it zstd-compressed, as packer push --zstd")
    for f in BuildConfig.options():
        switch = {"action": "store_true"} if f.default is False else {}
        b.add_argument("--" + f.name.replace("_", "-"), help=f.metadata["help"], **switch, **f.metadata["cli"])
    b.add_argument("-q", "--quiet", action="store_true", default=False, help="no progress, no skip list")


def _cmd_build(args) -> int:
    options = {name: value for name, value in vars(args).items() if name in api.BUILD_OPTIONS or name == "zstd"}
    bar = ProgressBar("packing", enabled=not args.quiet, unit="records")
    started = time.perf_counter()
    try:
        result = api.build(args.raw, args.out, **options, on_progress=bar)
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    if isinstance(result, api.PartReport):
        (i, n), r = result.part, result
        print(f"part {i}/{n}: {r.shards} of {r.total_shards} shards ({r.built} built, {r.reused} reused), "
              f"{r.items:,} records in {seconds:.1f} s; run 'packer commit {args.out}' once all {n} parts are done")
        return 0
    local = api.where_built(args.out)
    _summary(result, local, seconds, quiet=args.quiet, appended=getattr(args, "append", False))
    if remote_url(args.out):  # the built dataset went there
        zstd = " zstd-compressed" if getattr(args, "zstd", None) is not None else ""
        print(f"pushed -> {args.out}{zstd} (built in {local}, kept so that this command resumes or pushes again; "
              "remove it to free its disk)")
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
        mb_s = manifest.size_bytes / max(seconds, 1e-9) / 1e6
        rate += f", {mb_s:,.{0 if mb_s >= 10 else 1}f} MB/s written"
        waited = manifest.build.get("disk_wait")
        if waited is not None and waited >= DISK_BOUND:  # the cores were not what set the pace
            rate += f"; the workers spent {100 * waited:.0f}% of their time waiting on the disk"
    if not quiet and manifest.build.get("layout") and not appended:
        print(f"layout {manifest.build['layout']}")
    for line in _input_notes(manifest.build):
        print(line)
    empty = api.empty_classes(DatasetReader(out)) if manifest.classes is not None else []
    if empty:
        print(_empty_classes_line(empty, len(manifest.classes)))
    if appended:
        if new.get("new_classes"):
            first = len(manifest.classes) - len(new["new_classes"])
            print("new classes: " + ", ".join(f"{name} = {first + i}" for i, name in enumerate(new["new_classes"])) +
                  " (numbered after the dataset's classes, --allow-new-classes)")
        print(f"appended {new.get('found', 0):,} new records = packed {new.get('packed', 0):,} + skipped "
              f"{new.get('skipped', 0):,} in {seconds:.1f} s ({rate}); {out} now holds found {c['found']:,} = "
              f"packed {c['packed']:,} + skipped {c['skipped']:,} in {len(manifest.shards)} shards, "
              f"{human_bytes(manifest.size_bytes)}")
        return
    print(
        f"found {c['found']} = packed {c['packed']} + skipped {c['skipped']}; "
        f"{len(manifest.shards)} shards, {human_bytes(manifest.size_bytes)} in {seconds:.1f} s "
        f"({rate}) -> {out}"
    )


_BOX_NOTES = {"clipped": "clipped to their image", "dropped_no_area": "dropped (no area in their image)",
              "dropped_unknown_image": "dropped (of an image the annotation does not list)",
              "dropped_unknown_category": "dropped (of a category the annotation does not list)",
              "dropped_malformed": "dropped (not a bbox of 4 numbers)"}


def _input_notes(build: dict) -> list[str]:
    """What the build left out of its input, and the images whose transparency it dropped."""
    notes = []
    left = (build.get("input") or {}).get("not_packed")
    if left:
        notes.append(f"not packed: {', '.join(left)} (fields the input has; --image-key, --text-key, --label-key "
                     "and --id-key choose others)")
    if build.get("flattened"):
        n = build["flattened"]
        notes.append(f"{n:,} image{'s' if n != 1 else ''} had transparency, dropped as Pillow's convert('RGB') does; "
                     "--background R,G,B composites them over a colour instead")
    counted = (build.get("input") or {}).get("notes")
    if counted:  # what an annotation got wrong (COCO's boxes)
        notes.append("boxes: " + "; ".join(f"{n:,} {_BOX_NOTES.get(k, k)}" for k, n in counted.items()))
    if build.get("audio_clipped"):
        n = build["audio_clipped"]
        notes.append(f"{n:,} audio value{'s' if n != 1 else ''} past full scale clipped, or NaN stored as 0 "
                     "(FORMAT.md, \"Audio samples\")")
    return notes


def _cmd_commit(args) -> int:
    started = time.perf_counter()
    manifest = api.commit(args.out, max_skipped=args.max_skipped)
    _summary(manifest, args.out, time.perf_counter() - started, quiet=True)
    return 0


def _cmd_sizes(args) -> int:
    bar = ProgressBar("reading headers", enabled=not args.json, unit="images")
    try:
        report = api.sizes(args.raw, image_size=args.image_size, max_side=args.max_side, kind=args.kind,
                           sample=args.sample, on_progress=bar)
    finally:
        bar.close()
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    n, read, size, cap = report["records"], report["headers_read"], report["size"], report["max_side"]
    print(f"{args.raw}: {n:,} images; sizes from the headers of {read:,}"
          + (" (all)" if read == n else " spread over RAW, scaled up")
          + f"; the JPEG rows from {min(read, JPEG_SAMPLE):,} of them encoded as a build would")
    q = report["jpeg_quality"]
    rows = [(f"--image-size {size}", f"{size} x {size} centre crops", "fixed"),
            (f"--image-size {size} --store jpeg", f"... as JPEG, quality {q}", "jpeg_fixed"),
            (f"--image-size {size} --keep-aspect", f"shorter side {size}, longer <= {cap}", "keep_aspect"),
            ("  ... --store jpeg", f"... as JPEG, quality {q}", "jpeg_keep_aspect"),
            ("--image-size keep", "each image at its own size", "keep"),
            ("(the source files)", "JPEG, PNG ... as they are", "source")]
    for flag, what, key in rows:
        b = report["bytes"][key]
        print(f"  {flag:<36} {what:<36} {human_bytes(b):>10}  {b / max(n, 1):>12,.0f} B/image")
    if report["unreadable"]:
        print(f"  ({report['unreadable']:,} of those headers unreadable: the build would skip them)")
    return 0


def _empty_classes_line(empty: list[str], total: int) -> str:
    shown = ", ".join(empty[:CLASSES_SHOWN]) + (", ..." if len(empty) > CLASSES_SHOWN else "")
    return (f"{len(empty)} of {total} classes have no packed image: {shown} (their labels are kept, "
            "as torchvision's ImageFolder numbers them)")


def _cmd_info(args) -> int:
    d = api.info(args.out)
    skipped = d.pop("skipped")
    if args.json:
        if args.skipped:
            d["skipped"] = skipped
        print(json.dumps(d, indent=1))
        return 0
    cols = "; ".join(f"{n} {c['dtype']} {tuple(c['shape'])}" for n, c in d["columns"].items())
    print(f"dataset   {d['path']} ({d['format']}, kind {d['kind']})")
    packed = f" ({human_bytes(d['archive_bytes'])} compressed)" if "archive_bytes" in d else ""
    print(f"samples   {d['num_samples']:,} in {d['num_shards']} shards, {human_bytes(d['size_bytes'])}{packed}")
    print(f"columns   {cols}")
    if d["input"] and d["input"].get("form") != "folder":
        fields = ", ".join(f"{role}: {name}" for role, name in d["input"]["fields"].items() if name)
        print(f"input     {d['input']['form']} ({fields})")
    if d["images"]:
        print(f"images    {d['images']}")
    if d["audio"]:
        a = d["audio"]
        print(f"audio     {a['sample_rate']:,} Hz, {a['channels']} channel{'s' if a['channels'] > 1 else ''}, "
              f"{'int16' if a['dtype'] == '<i2' else 'float32'}; " + (f"{a['seconds'] / 3600:,.2f} h" if a['seconds'] >= 3600
              else f"{a['seconds']:,.1f} s") + " in all")
    for line in _input_notes({"input": d["input"], "flattened": d["flattened"], "audio_clipped": d["audio_clipped"]}):
        print(f"          {line}")
    if d["classes"] is not None:
        shown = ", ".join(d["classes"][:10]) + (" ..." if len(d["classes"]) > 10 else "")
        print(f"classes   {len(d['classes'])}: {shown}")
        if d["empty_classes"]:
            print(f"          {_empty_classes_line(d['empty_classes'], len(d['classes']))}")
    if d["tokenizer"]:
        t = d["tokenizer"]
        print(f"tokenizer {t['path']} (sha256 {t['sha256'][:12]}, vocab {t['vocab_size']:,}, {t['dtype']}, eos {t['eos_id']})")
    if d["chat_template"]:
        t = d["chat_template"]
        masks = "{% generation %} blocks" if t["generation_blocks"] else "each assistant turn and its end"
        print(f"template  {t['path']} (sha256 {t['sha256'][:12]}; loss mask: {masks})")
    c = d["counts"]
    print(f"records   found {c['found']:,} = packed {c['packed']:,} + skipped {c['skipped']:,}")
    if args.skipped:
        for skip in skipped:
            print(f"skipped   {skip['key']} [{skip['stage']}]: {skip['reason']}")
    return 0


def _cmd_show(args) -> int:
    d = api.show(args.out, n=args.n, png=args.png)
    if args.json:
        print(json.dumps({k: v for k, v in d.items() if k != "lines"}, indent=1))
        return 0
    print(f"dataset   {d['path']} ({d['kind']}, {d['num_samples']:,} samples): {len(d['samples'])} of them, spread "
          "evenly")
    for text in d["lines"]:
        print(text)
    if d["png"]:
        print(f"png -> {d['png']}")
    return 0


def _cmd_verify(args) -> int:
    bar = ProgressBar("verifying", enabled=True)
    try:
        result = api.verify(args.out, cache=args.cache, on_progress=bar)
    except IntegrityError as exc:
        bar.close()
        print(f"packer verify: FAILED: {exc}", file=sys.stderr)
        return 1
    bar.close()
    if "removed" in result:
        if result["removed"]:
            print(f"packer verify: FAILED: {len(result['removed'])} cached files no longer matched their checksums "
                  f"and were removed (fetched again when read): {', '.join(result['removed'][:5])}", file=sys.stderr)
            return 1
        if result.get("empty"):
            print(f"nothing to verify: no copy of {args.out} (its build published now) is cached in {result['cache']}")
            return 0
        print(f"ok: {result['files']} cached files, {human_bytes(result['size_bytes'])} verified in {result['cache']}")
        return 0
    print(f"ok: {result['files']} files, {human_bytes(result['size_bytes'])}, {result['num_samples']:,} samples verified")
    return 0


def _cmd_merge(args) -> int:
    started = time.perf_counter()
    manifest = api.merge(args.inputs, args.out, overwrite=args.overwrite, allow_duplicate_keys=args.allow_duplicate_keys)
    print(f"merged {len(args.inputs)} datasets: {manifest.num_samples:,} samples in {len(manifest.shards)} shards, "
          f"{human_bytes(manifest.size_bytes)} in {time.perf_counter() - started:.1f} s -> {args.out}")
    return 0


def _transfer_line(verb: str, t, dest: Path) -> str:
    return (f"{verb} {human_bytes(t.raw_bytes)} <-> {human_bytes(t.packed_bytes)} zstd (ratio {t.ratio:.2f}x) "
            f"in {t.seconds:.1f} s ({t.mb_per_s:,.0f} MB/s of raw data) -> {dest}")


def _cmd_pack(args) -> int:
    t = api.pack(args.out, args.archive, level=args.level, threads=args.threads, overwrite=args.overwrite)
    print(_transfer_line("packed", t, args.archive))
    return 0


def _cmd_unpack(args) -> int:
    try:
        t = api.unpack(args.archive, args.out, threads=args.threads, overwrite=args.overwrite)
    except IntegrityError as exc:
        print(f"packer unpack: FAILED: {exc}", file=sys.stderr)
        return 1
    print(_transfer_line("unpacked and verified", t, args.out))
    return 0


def _cmd_push(args) -> int:
    m = api.push(args.out, args.url, zstd=args.zstd)
    samples, size = sum(s.num_samples for s in m.shards), sum(s.size_bytes for s in m.shards)
    last = "zstd-compressed, archive.json last" if args.zstd is not None or (args.out / "archive.json").is_file() \
        else "the manifest last"
    print(f"pushed {args.out} -> {args.url}: {samples:,} samples, {human_bytes(size)}, {last}")
    return 0


def _cmd_pull(args) -> int:
    mine = Path(args.out) / fmt.MANIFEST_NAME
    there = mine.is_file()
    m = api.pull(args.url, args.out)
    if there:
        print(f"{args.out} holds {args.url} already (run 'packer verify {args.out}' to re-hash it)")
        return 0
    print(f"pulled {args.url} -> {args.out}: {sum(s.num_samples for s in m.shards):,} samples, every file verified")
    return 0


COMMANDS = {"build": _cmd_build, "commit": _cmd_commit, "sizes": _cmd_sizes, "info": _cmd_info, "show": _cmd_show,
            "verify": _cmd_verify,
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
            hint = (f"; no dataset was published, whole shards stay in {api.where_built(args.out) / fmt.STAGING_DIR}: "
                    "free space and run the same command to resume, or delete it")
        print(f"packer {args.command}: error: {where}{exc.strerror or exc}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = ("; whole shards are kept: run the same command again to go on"
                if args.command == "build" else "")
        print(f"packer {args.command}: interrupted{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
