"""`bench remote`: Loader over a dataset in object storage against the same dataset on local
disk, and against the store's raw GET rate measured here: a cold epoch (an empty cache), warm
epochs (the cache full), time to first batch; bytes downloaded per epoch at cache limits of
100%, 50%, 30% and 10% of the dataset, per order; and per rank with 4 ranks on separate caches.
The block order reads within a window of 8,192 positions, more than the photo crops' dataset
holds, so its rows (25% of the dataset, and 4 ranks) use a dataset of many 16 px images.

The store is an S3 server started on loopback (`bench.stores`: SeaweedFS where its binary is
installed, else `bench.s3lite`, ours; `--s3-server` picks), or `--url` with the standard AWS
environment. On loopback the network is memory: the figures say what the cache
and the fetch ahead cost, not what a real link gives.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

from . import data
from .measure import alternated, dir_bytes, raw_get_rate, share_limit, timed_pass
from .stores import link
from .loaders_bench import machine
from .prepare import prepare_dataset, prepare_images

ORDERS = ("sequential", "block", "random")
LIMITS = (1.0, 0.5, 0.3, 0.1)
BLOCK_LIMIT = 0.25  # the block order's row, on the dataset of small samples
RANKS = 4
ZSTD_LEVEL = 3  # the compressed push's row (packer push --zstd's default)


def _say(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


class _Server(NamedTuple):
    """The store the dataset is pushed to."""

    url: str  # where the dataset is pushed
    name: str | None  # the loopback server's (stores.S3_SERVERS); None with --url
    shown: str  # what the JSON's "url" says
    endpoint: str | None  # the loopback server's; None with --url


def _serve(stack: ExitStack, args, work: Path) -> _Server:
    """--url with the AWS environment, or an S3 server on loopback (--s3-server) for the life of
    `stack`, the AWS environment set to reach it."""
    from .stores import KEY, SECRET, S3_SERVERS, s3_server_named

    if args.url is not None:
        return _Server(args.url, None, args.url, None)
    server = work / "s3"
    shutil.rmtree(server, ignore_errors=True)
    server.mkdir()
    name = s3_server_named(getattr(args, "s3_server", None))
    serve, shown = S3_SERVERS[name]
    endpoint = stack.enter_context(serve(server))
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET,
                      AWS_REGION=os.environ.get("AWS_REGION", "us-east-1"))
    return _Server("s3://mmpack-bench/images", name, shown, endpoint)


def bench_remote(args) -> dict:
    """The crops pushed to the store, then (unless --throttle or --nodes, each alone) every row in
    the order measured: raw GETs and local disk, cold and warm epochs, zstd, the link, the peers,
    a first batch by rows, cache limits and ranks."""
    from loaders import MMapDataset
    import packer
    from packer.remote import DOWNLOADS

    work = args.work or Path(tempfile.mkdtemp(prefix="mmpack-bench-remote-"))
    work.mkdir(parents=True, exist_ok=True)
    raw, _, _ = prepare_images(work, args.images)
    _, out, _ = prepare_dataset(work, f"images-{args.shard_size}", args.images, lambda r: shutil.copytree(raw, r),
                                {"shard_size": args.shard_size})
    local = MMapDataset(out)
    total = local.manifest.size_bytes
    with ExitStack() as stack:
        server = _serve(stack, args, work)
        url = server.url
        start = time.perf_counter()
        packer.push(out, url)
        push_s = time.perf_counter() - start
        caches = Path(tempfile.mkdtemp(prefix="caches-", dir=work))
        stack.callback(shutil.rmtree, caches, True)
        fresh = iter(range(10**6))

        def opened(limit=None, where=url):  # a fresh cache each: what a node that never read it downloads
            return MMapDataset(where, cache_dir=caches / str(next(fresh)), cache_limit=limit)

        if getattr(args, "throttle", False) and args.url is None:  # a store that throttles, alone
            return _throttled(server, local)
        if getattr(args, "nodes", 0) and args.url is None:  # the multi-node job alone, on the small images
            return _nodes(args, work, server, local, caches)
        if getattr(args, "peer_cache", None) is not None and args.url is None:  # the peers under a limit, alone
            return {"command": "bench remote --peers --peer-cache", "machine": machine(), "url": server.shown,
                    "s3_server": server.name, "images": len(local), "shards": len(local.manifest.shards),
                    "dataset_bytes": total, "batch_size": args.batch_size, "peer_cache": args.peer_cache,
                    "peers": _peer_rows(args, server, local, work, args.peer_cache)}
        loader_kw = dict(batch_size=args.batch_size, seed=0)
        raw_rate, to_disk, local_rate = _raw_and_local(url, local, caches, loader_kw, args.passes)
        cold, warm, warm_shares = _cold_and_warm(opened, local, loader_kw, args.passes)
        zstd = _zstd_cold(out, url, opened, total, loader_kw, args.passes)
        jpeg = _jpeg_pushed(args, work, raw, url)
        linked = _through_link(server.endpoint, args.link_mb, opened, url, local.manifest, loader_kw, jpeg) \
            if args.url is None else None
        peers = _peer_rows(args, server, local, work)
        rows_first = _rows_first(opened, local, loader_kw, args.passes)
        _say("a cold first batch by rows (as for a dataset whose first batch's shards hold over 512 MiB): "
             f"{rows_first['first_batch_s']:.2f} s")
        limits, ranks = _limits_and_ranks(args, work, server, opened, caches, local, loader_kw)
    cold_rate = statistics.median(c["bytes_per_s"] for c in cold)
    return {"command": "bench remote", "machine": machine(), "url": server.shown, "s3_server": server.name,
            "images": len(local), "shards": len(local.manifest.shards), "dataset_bytes": total,
            "batch_size": args.batch_size, "downloads_at_once": DOWNLOADS, "push_bytes_per_s": total / push_s,
            "raw_get_bytes_per_s": raw_rate, "raw_get_to_files_bytes_per_s": to_disk, "local_samples_per_s": local_rate,
            "cold": cold, "cold_rows_first": rows_first, "cold_of_raw_get": cold_rate / raw_rate, "cold_of_raw_get_to_files": cold_rate / to_disk,
            "zstd_level": ZSTD_LEVEL, "zstd_cold": zstd, "link": linked,
            "warm_samples_per_s": statistics.median(warm), "warm_of_local": statistics.median(warm_shares),
            "warm_of_local_range": [min(warm_shares), max(warm_shares)],
            "limits": limits, "ranks": ranks, "peers": peers}


def _throttled(server: _Server, local) -> dict:
    """--throttle: GETs of the dataset's small files through a store that throttles (throttle_bench)."""
    from .throttle_bench import bench_throttle

    keys = [f.path for s in local.manifest.shards for f in s.files if f.size_bytes <= 1 << 16]
    return {"command": "bench remote --throttle", "machine": machine(), "url": server.shown, "s3_server": server.name,
            "throttle": bench_throttle(server.endpoint, server.url, keys, storm_s=6.0)}


def _nodes(args, work: Path, server: _Server, local, caches: Path) -> dict:
    """--nodes: a job of N nodes (nodes_bench), on the small images where --block-samples makes them."""
    from .nodes_bench import bench_nodes

    small, where = _small(work, args, server.url) if args.block_samples else (local, server.url)
    return {"command": "bench remote --nodes", "machine": machine(), "url": server.shown, "s3_server": server.name,
            "images": len(small), "shards": len(small.manifest.shards), "dataset_bytes": small.manifest.size_bytes,
            "batch_size": args.batch_size, "nodes": bench_nodes(where, server.endpoint, small, caches, args.nodes,
                                                                 args.ranks_per_node, args.link_mb,
                                                                 args.batch_size, args.node_caches,
                                                                 args.block_window)}


def _raw_and_local(url: str, local, caches: Path, loader_kw: dict, passes: int) -> tuple[float, float, float]:
    """What a remote epoch is held against: the store's raw GET rate into memory and into files
    (best of 2), and the Loader's images/s from local disk (median of `passes` after a warm-up)."""
    from loaders import Loader
    from packer.remote import DOWNLOADS

    raw_rate = max(raw_get_rate(url, local.manifest, DOWNLOADS) for _ in range(2))
    to_disk = max(raw_get_rate(url, local.manifest, DOWNLOADS, into=caches / "raw") for _ in range(2))
    _say(f"raw GET rate {raw_rate / 1e6:,.0f} MB/s into memory, {to_disk / 1e6:,.0f} MB/s into files")
    Loader(local, **loader_kw)  # imports, first maps
    local_rates = []
    for _ in range(passes + 1):
        n, s, _ = timed_pass(Loader(local, **loader_kw))
        local_rates.append(n / s)
    local_rate = statistics.median(local_rates[1:])
    _say(f"local disk {local_rate:,.0f} images/s")
    return raw_rate, to_disk, local_rate


def _cold_and_warm(opened, local, loader_kw: dict, passes: int) -> tuple[list[dict], list[float], list[float]]:
    """`passes` cold epochs, each from an empty cache, then `passes` warm ones on the last one's
    cache (images/s), and the warm Loader's share of local disk's in rounds alternating the two."""
    from loaders import Loader

    total = local.manifest.size_bytes
    cold, warm = [], []
    for p in range(passes):  # the last pass's cache kept for the warm ones
        ds = opened()
        cold.append(_cold(ds, total, loader_kw, drop=p < passes - 1))
    for _ in range(passes):
        n, s, _ = timed_pass(Loader(ds, **loader_kw))
        warm.append(n / s)
    cold_rate = statistics.median(c["bytes_per_s"] for c in cold)
    # the warm share from rounds alternating the two Loaders: rows timed apart differ by more
    warm_shares = alternated(Loader(local, **loader_kw), Loader(ds, **loader_kw), rounds=passes + 2)
    _say(f"cold {cold_rate / 1e6:,.0f} MB/s, warm {statistics.median(warm):,.0f} images/s, "
         f"{100 * statistics.median(warm_shares):.0f}% of local disk alternated")
    return cold, warm, warm_shares


def _zstd_cold(out: Path, url: str, opened, total: int, loader_kw: dict, passes: int) -> list[dict]:
    """The dataset pushed again compressed (URL-zstd), and `passes` cold epochs of it."""
    import packer

    packer.push(out, url + "-zstd", zstd=ZSTD_LEVEL)
    zstd = [_cold(opened(where=url + "-zstd"), total, loader_kw, drop=True) for _ in range(passes)]
    _say(f"zstd -{ZSTD_LEVEL} cold {statistics.median(c['bytes_per_s'] for c in zstd) / 1e6:,.0f} MB/s restored, "
         f"{statistics.median(c['link_share'] for c in zstd):.2f}x the dataset over the link")
    return zstd


def _jpeg_pushed(args, work: Path, raw: Path, url: str) -> str | None:
    """--jpeg: the JPEG lane of the same crops built and pushed to URL-jpeg (read beside the pixels
    through the link); its URL, or None."""
    import packer

    if not getattr(args, "jpeg", False):
        return None
    _, jpeg_out, _ = prepare_dataset(work, f"images-jpeg-{args.shard_size}", args.images,
                                     lambda r: shutil.copytree(raw, r),
                                     {"shard_size": args.shard_size, "store": "jpeg"})
    packer.push(jpeg_out, jpeg := url + "-jpeg")
    return jpeg


def _peer_rows(args, server: _Server, local, work: Path, share: float | None = None) -> list[dict] | None:
    """--peers on a loopback server: WebDataset, LitData and Streaming with their own S3 readers
    (each through a cache of `share` of its dataset, where given)."""
    if not (getattr(args, "peers", False) and args.url is None):
        return None
    from .remote_peers import peer_rows

    peers = peer_rows(local, server.url, work, server.endpoint, args.batch_size, args.workers, share)
    for row in peers:
        _say(f"{row['system']}: {row.get('skipped') or row.get('error') or row['epochs']}")
    return peers


def _limits_and_ranks(args, work: Path, server: _Server, opened, caches: Path, local,
                      loader_kw: dict) -> tuple[list[dict], list[dict]]:
    """Each order at each cache limit (LIMITS), what crossed counted by a proxy in front of a
    loopback server; RANKS ranks on caches of their own; and with --block-samples the block
    order's rows on the dataset of small images."""
    url, endpoint = server.url, server.endpoint
    counts: dict = {}  # what crossed, counted by a proxy in front of the server (not by our counters)
    with (link(endpoint, None, counts) if args.url is None else contextlib.nullcontext(None)) as proxy:
        if proxy is not None:
            os.environ["AWS_ENDPOINT_URL"] = proxy
        limits = [_limited(opened, url, caches, local, share, order, loader_kw, counts)
                  for order in ORDERS for share in LIMITS]
        if proxy is not None:
            os.environ["AWS_ENDPOINT_URL"] = endpoint
    ranks = [_rank(opened, local, rank, "sequential", loader_kw) for rank in range(RANKS)]
    # block order needs a dataset many times its window (8,192 samples): small samples, in
    # shards well under a block (1,024 samples), since a shard at a block's edge is read in two
    # windows and a small cache downloads it twice
    if args.block_samples:
        small, _ = _small(work, args, url)
        opened_small = functools.partial(opened, where=url + "-small")
        limits.append(_limited(opened_small, url + "-small", caches, small, BLOCK_LIMIT, "block", loader_kw, {}))
        ranks += [_rank(opened_small, small, rank, "block", loader_kw) for rank in range(RANKS)]
    return limits, ranks


def _small(work: Path, args, url: str):
    """The dataset of small images (block order needs one many times its window), pushed to URL-small."""
    from loaders import MMapDataset
    import packer

    side = getattr(args, "block_side", 16)
    _, small_out, _ = prepare_dataset(work, "small", args.block_samples, lambda r: data.make_image_folders(
        r, args.block_samples, seed=1, min_side=side, max_side=3 * side), {"image_size": side, "shard_size": "64KB"})
    packer.push(small_out, url + "-small")
    return MMapDataset(small_out), url + "-small"


def _cold(ds, total: int, loader_kw: dict, drop: bool) -> dict:
    """One epoch of `ds` from an empty cache: images/s, dataset bytes/s, bytes over the link per
    second and over the dataset's; `drop`: its files removed after, so that no pass starts
    behind another's writes."""
    from loaders import Loader

    n, s, first = timed_pass(Loader(ds, **loader_kw))
    if drop:
        shutil.rmtree(ds.root)
    return {"samples_per_s": n / s, "bytes_per_s": total / s, "link_bytes_per_s": ds.bytes_downloaded / s,
            "link_share": ds.bytes_downloaded / total, "first_batch_s": first}


def _rows_first(opened, local, loader_kw: dict, passes: int) -> dict:
    """The first batch of cold passes that read it by range whatever the dataset's size (the
    rule for a batch whose shards hold over COLD_ROWS_BYTES): seconds to it (median and each) and
    bytes over the link by then, next to the batch's own bytes."""
    from loaders import Loader
    from packer.remote import residency

    saved, residency.COLD_ROWS_BYTES = residency.COLD_ROWS_BYTES, 0
    seconds, link = [], []
    try:
        for _ in range(passes):
            ds = opened()
            loader = Loader(ds, **loader_kw)
            start = time.perf_counter()
            batches = iter(loader)  # kept: a dropped iterator would stop its pass's downloads before the clock
            next(batches)
            seconds.append(time.perf_counter() - start)
            link.append(ds.bytes_downloaded)
            batches.close()
            loader.close()
            shutil.rmtree(ds.root)
    finally:
        residency.COLD_ROWS_BYTES = saved
    return {"first_batch_s": statistics.median(seconds), "first_batch_s_each": seconds,
            "link_bytes": statistics.median(link), "batch_bytes": local.manifest.size_bytes * loader_kw["batch_size"] / len(local)}


def _through_link(endpoint: str, mb_per_s: float, opened, url: str, manifest, loader_kw: dict,
                  jpeg: str | None = None) -> dict | None:
    """The raw GET rate and a cold epoch of the plain and of the compressed push through a link
    of `mb_per_s` to the server (`stores.link`): the cold path where the link, not the CPU, is
    the limit, and what compression gives there; and of the JPEG lane's push at `jpeg`."""
    from packer.remote import DOWNLOADS

    if not mb_per_s:
        return None
    total = manifest.size_bytes
    with link(endpoint, mb_per_s * 1e6) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = proxy  # read by the clients made from here on
        try:
            raw = raw_get_rate(url, manifest, DOWNLOADS)
            plain = _cold(opened(), total, loader_kw, drop=True)
            packed = _cold(opened(where=url + "-zstd"), total, loader_kw, drop=True)
            lane = _cold(opened(where=jpeg), total, loader_kw, drop=True) if jpeg else None
        finally:
            os.environ["AWS_ENDPOINT_URL"] = endpoint
    _say(f"through a link of {mb_per_s:g} MB/s: raw GETs {raw / 1e6:,.0f} MB/s, cold plain "
         f"{plain['bytes_per_s'] / 1e6:,.0f} MB/s, zstd {packed['bytes_per_s'] / 1e6:,.0f} MB/s restored"
         + (f"; images/s plain {plain['samples_per_s']:,.0f}, JPEG lane {lane['samples_per_s']:,.0f}" if lane else ""))
    return {"link_mb_per_s": mb_per_s, "raw_get_bytes_per_s": raw, "plain": plain, "zstd": packed,
            "cold_of_raw_get": plain["bytes_per_s"] / raw, "jpeg": lane}


def _limited(opened, url: str, caches: Path, local, share: float, order: str, loader_kw: dict, counts: dict) -> dict:
    """Two epochs of `order` through a cache of `share` of the dataset (plus its index files):
    bytes downloaded per epoch over the dataset's (`ds.traffic`'s, and the proxy's where `counts`
    counts), or why the limit was refused."""
    from loaders import Loader

    total = local.manifest.size_bytes
    limit = share_limit(share, url, caches, local.manifest)
    row = {"order": order, "limit_share": share, "limit_bytes": limit, "images": len(local)}
    try:
        ds = opened(limit)
        loader = Loader(ds, **loader_kw, order=order)
        per_epoch = []
        for _ in range(2):
            before, crossed = ds.traffic, dict(counts)
            n, s, _ = timed_pass(loader)
            after = ds.traffic
            if counts:
                per_epoch.append({"link_share": (counts["bytes"] - crossed["bytes"]) / total,
                                  "link_gets": counts["gets"] - crossed["gets"]})
            else:
                per_epoch.append({})
            per_epoch[-1].update({"downloaded_share": (after["bytes"] - before["bytes"]) / total, "samples_per_s": n / s,
                              "gets": after["gets"] - before["gets"],
                              "shard_hits": after["shard_hits"] - before["shard_hits"],
                              "shard_downloads": after["shard_downloads"] - before["shard_downloads"]})
        row.update(epochs=per_epoch, cache_bytes=dir_bytes(ds.root))
    except Exception as exc:  # noqa: BLE001 - a refused limit is a row saying why
        row["refused"] = str(exc).splitlines()[0][:300]
    _say(f"{order} at {share:.0%} of {len(local):,} images: {row.get('refused') or row['epochs'][-1]}")
    return row


def _rank(opened, local, rank: int, order: str, loader_kw: dict) -> dict:
    """One epoch of rank `rank` of RANKS, on a cache of its own (a node): the shards its part of
    the epoch reads, and what it downloads (with the next epoch's first batches, fetched ahead)."""
    from loaders import Loader

    import numpy as np

    shards = local.manifest.shards
    total = local.manifest.size_bytes
    ds = opened()
    loader = Loader(ds, **loader_kw, order=order, rank=rank, world_size=RANKS)
    epochs = loader.epochs.twin()
    p = epochs.upcoming()
    ends = np.cumsum([s.num_samples for s in shards])
    touched = np.unique(np.searchsorted(ends, epochs.ids(p, 0, epochs.per_rank()), side="right"))
    n, _, _ = timed_pass(loader)
    return {"rank": rank, "order": order, "images": len(local), "downloaded_share": ds.bytes_downloaded / total,
            "touched_share": sum(shards[k].size_bytes for k in touched.tolist()) / total, "samples": n}
