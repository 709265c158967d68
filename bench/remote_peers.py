"""`bench remote`'s peers: the same decoded pixels in each peer's own format, pushed to the same
S3 server and read with the peer's own S3 reader and cache, beside mmpack's Loader over its URL:
a cold epoch (an empty cache) and a warm one, the first batch, and what crossed the link, counted
by a proxy in front of the server (`stores.link`), not by any reader's own counters.

WebDataset reads tars as HTTP streams (presigned URLs, through curl) and keeps no cache, so its
warm epoch fetches again. LitData reads its chunks into its cache dir, through boto3 (its obstore
path cannot reach a plain-http endpoint). MosaicML Streaming reads its MDS shards into its local
dir through boto3 (`S3_ENDPOINT_URL`); it imports torchvision, whose PyPI wheels load beside a
PyPI torch, not beside the CPU build of torch 2.13.0 (see bench/peers-requirements.txt), so its
row comes from a venv with torch and torchvision from PyPI. Each adapter imports its peer lazily;
a missing one is a row saying why, never an error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from .measure import dir_bytes, share_limit
from .peers import MP_CONTEXT, NAMES, availability

PEERS = ("webdataset", "litdata", "streaming")
BUCKET = "mmpack-bench"


@contextlib.contextmanager
def _stdout_to_stderr():
    """File descriptor 1 pointed at 2 while the block runs (child processes' prints too)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _put_dir(endpoint: str, local: Path, prefix: str) -> None:
    """Every file under `local` as an object under `prefix` (the peer's own layout)."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        s3.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(local)}")


def _epochs(make, counts: dict, count_of) -> list[dict]:
    """A cold epoch then a warm one of the loader `make()` gives: samples/s, first batch, and
    the bytes and GETs the proxy counted in each."""
    out = []
    for _ in range(2):
        before = dict(counts)
        loader = make()
        started = time.perf_counter()
        first, n = None, 0
        for batch in loader:
            if first is None:
                first = time.perf_counter() - started
            n += count_of(batch)
        seconds = time.perf_counter() - started
        out.append({"samples": n, "samples_per_s": n / seconds, "first_batch_s": first,
                    "link_bytes": counts["bytes"] - before["bytes"], "gets": counts["gets"] - before["gets"]})
    return out


def _decoded(local, i: int) -> tuple[np.ndarray, int]:
    s = local[i]
    return s["image"].numpy(), int(s["label"])


def webdataset_row(local, work: Path, endpoint: str, proxy: str, counts: dict, batch_size: int, workers: int) -> dict:
    import boto3
    import webdataset as wds

    out = work / "wds"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    per_shard = -(-len(local) // max(4, len(local.manifest.shards)))  # as many shards as mmpack's
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(len(local)):
            image, label = _decoded(local, i)
            sink.write({"__key__": f"{i:08d}", "npy": image, "cls": label})
    _put_dir(endpoint, out, "peers/wds")
    s3 = boto3.client("s3", endpoint_url=proxy)  # signed for the proxy's host: what the reader asks
    urls = [f"pipe:curl -s -f {s3.generate_presigned_url('get_object', Params={'Bucket': BUCKET, 'Key': f'peers/wds/{p.name}'}, ExpiresIn=3600)!r}"
            for p in sorted(out.glob("shard-*.tar"))]

    def make():
        pipe = wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False).shuffle(1000)
        pipe = pipe.decode().to_tuple("npy", "cls").batched(batch_size)
        return torch.utils.data.DataLoader(pipe, batch_size=None, num_workers=workers,
                                           multiprocessing_context=MP_CONTEXT if workers else None)
    return {"epochs": _epochs(make, counts, lambda b: len(b[1])), "cache": "none (each epoch streams the tars again)"}


class _LitItem:
    """litdata.optimize's fn: picklable, opens the mmpack dataset in each of its workers."""

    def __init__(self, root: str):
        self.root, self._ds = root, None

    def __call__(self, i: int) -> dict:
        if self._ds is None:
            from loaders import MMapDataset

            self._ds = MMapDataset(self.root, columns=["image", "label"])
        s = self._ds[i]
        return {"image": s["image"].numpy().copy(), "label": int(s["label"])}


def litdata_row(local, work: Path, endpoint: str, proxy: str, counts: dict, batch_size: int, workers: int,
                share: float | None = None) -> dict:
    import litdata
    from litdata.streaming.resolver import Dir

    out = work / "litdata"
    shutil.rmtree(out, ignore_errors=True)
    with _stdout_to_stderr():  # its progress, and its workers', stay out of the bench's table
        # its default chunks of 64 MB; under a limit, mmpack's shard size (as Streaming's row): a limit
        # that held three 64 MB chunks left its two workers, each fetching ahead, waiting on each other
        chunk = "64MB" if share is None else max(1 << 20, local.manifest.size_bytes // len(local.manifest.shards))
        litdata.optimize(fn=_LitItem(str(local.root)), inputs=list(range(len(local))), output_dir=str(out),
                         chunk_bytes=chunk, num_workers=max(1, workers), mode="overwrite")
    _put_dir(endpoint, out, "peers/litdata")
    cache = work / "litdata-cache"
    shutil.rmtree(cache, ignore_errors=True)
    # its S3 client reads these. Its obstore path gives obstore no allow_http, so it cannot reach
    # an http:// endpoint such as the loopback server's ("BadScheme"): its boto3 path, which it
    # takes where obstore is not installed, reads the chunks here
    from litdata.streaming import downloader

    downloader._OBSTORE_AVAILABLE = False
    os.environ["AWS_ENDPOINT_URL"] = proxy

    limit = None if share is None else int(share * dir_bytes(out))

    def make():
        ds = litdata.StreamingDataset(Dir(path=str(cache), url=f"s3://{BUCKET}/peers/litdata"), shuffle=True,
                                      max_cache_size=limit)
        return litdata.StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers,
                                           multiprocessing_context=MP_CONTEXT if workers else None)
    try:
        with warnings.catch_warnings():  # its advice to hold 25 GB or more, said of any smaller limit
            warnings.simplefilter("ignore")
            return {"epochs": _epochs(make, counts, lambda b: len(b["label"])), "cache": str(cache),
                    "limit_bytes": limit}
    finally:
        os.environ["AWS_ENDPOINT_URL"] = endpoint


def streaming_row(local, work: Path, endpoint: str, proxy: str, counts: dict, batch_size: int, workers: int,
                  share: float | None = None) -> dict:
    from streaming import MDSWriter, StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    out = work / "streaming"
    shutil.rmtree(out, ignore_errors=True)
    shards = local.manifest.shards  # as many shards as mmpack's, of about its size
    shard_bytes = max(1 << 20, sum(shard.size_bytes for shard in shards) // len(shards))
    with MDSWriter(out=str(out), columns={"image": "ndarray", "label": "int"}, size_limit=shard_bytes) as sink:
        for i in range(len(local)):
            image, label = _decoded(local, i)
            sink.write({"image": image, "label": label})
    _put_dir(endpoint, out, "peers/streaming")
    cache = work / "streaming-cache"
    shutil.rmtree(cache, ignore_errors=True)
    clean_stale_shared_memory()
    os.environ["S3_ENDPOINT_URL"] = proxy
    made = []

    def make():  # one dataset for both epochs: its local dir is its cache (a second one there is refused)
        if not made:
            limit = None if share is None else int(share * dir_bytes(out))
            ds = StreamingDataset(remote=f"s3://{BUCKET}/peers/streaming", local=str(cache), shuffle=True,
                                  batch_size=batch_size, cache_limit=limit)
            made.append(StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers,
                                            multiprocessing_context=MP_CONTEXT if workers else None))
        return made[0]
    try:
        with _stdout_to_stderr():
            return {"epochs": _epochs(make, counts, lambda b: len(b["label"])), "cache": str(cache)}
    finally:
        os.environ.pop("S3_ENDPOINT_URL", None)


def mmpack_rows(local, url: str, work: Path, proxy: str, endpoint: str, counts: dict, batch_size: int,
                share: float | None = None) -> list[dict]:
    """mmpack's Loader over its URL, as it reads by default; under a cache limit of `share` of
    the dataset's bytes (and its index files), in random order (a batch's rows by range: about
    the dataset once, a request a few rows) and in block order with the window whose shards fit
    the limit (`packer.remote.limits.fitting_window`: whole shards, each fetched once an epoch,
    a request a file), the counterpart of LitData's and Streaming's shuffles, which deal whole
    chunks to workers and shuffle inside them."""
    from loaders import Loader, MMapDataset
    from packer.remote.limits import fitting_window

    os.environ["AWS_ENDPOINT_URL"] = proxy
    rows = []
    try:
        for order in ("random",) if share is None else ("random", "block"):
            cache = work / f"mmpack-peers-cache-{order}"
            shutil.rmtree(cache, ignore_errors=True)
            limit = None if share is None else share_limit(share, url, cache, local.manifest)
            ds = MMapDataset(url, cache_dir=cache, cache_limit=limit)
            kw = {"order": order}
            if order == "block":
                with warnings.catch_warnings():  # the default window's warning names the one found here
                    warnings.simplefilter("ignore")
                    probe = Loader(ds, batch_size, seed=0, order="block")
                kw["block_window"] = fitting_window(probe.source.residency, probe.epochs)
                probe.close()
            how = "" if share is None else f", {order} order" + (
                f", block_window={kw['block_window']}" if order == "block" else ", rows by range") + \
                f", cache {share:.0%}"
            rows.append({"system": f"mmpack Loader over {url}{how}", "cache": str(cache), "limit_bytes": limit, **kw,
                         "epochs": _epochs(lambda ds=ds, kw=kw: Loader(ds, batch_size, seed=0, **kw), counts,
                                           lambda b: len(b["label"]))})
    finally:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
    return rows


ROWS = {"webdataset": webdataset_row, "litdata": litdata_row, "streaming": streaming_row}


def peer_rows(local, url: str, work: Path, endpoint: str, batch_size: int, workers: int,
              share: float | None = None) -> list[dict]:
    """mmpack's rows and each peer's (or why it has none), through one counting proxy; with
    `share`, each through a cache limit of that share of its own dataset's bytes (WebDataset
    keeps no cache: its row is as without one)."""
    from .stores import link

    counts: dict = {}
    rows = []
    with link(endpoint, None, counts) as proxy:
        rows += mmpack_rows(local, url, work, proxy, endpoint, counts, batch_size, share)
        for peer in PEERS:
            name = f"{NAMES[peer]} (its S3 reader, DataLoader {workers} workers)"
            why = availability(peer) or (None if peer in ROWS else "no S3 row for it here")
            if why:
                rows.append({"system": NAMES[peer], "skipped": why})
                continue
            try:
                kw = {"share": share} if share is not None and peer != "webdataset" else {}
                rows.append({"system": name + (f", cache {share:.0%}" if kw else ""),
                             **ROWS[peer](local, work, endpoint, proxy, counts, batch_size, workers, **kw)})
            except Exception as exc:  # noqa: BLE001 - a peer that fails is a row saying how
                rows.append({"system": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
    return rows
