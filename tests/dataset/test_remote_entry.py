"""Opening a dataset in object storage (packer.remote.entry): its index files at the open, a shard
when it is read, one download for processes that open it at once, and the build a reader opened
kept when another is pushed."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch

from loaders import Loader, MMapDataset, TokenWindows
from packer.cli import main
from packer.errors import IntegrityError

from .remote import NEEDS_SERVER, _url

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


def test_readers_over_a_url_give_the_local_batches(s3, built, tmp_path):
    images, text = _url(tmp_path, "images"), _url(tmp_path, "text")
    assert main(["push", str(built["images"]), images]) == 0 and main(["push", str(built["text"]), text]) == 0
    remote, local = MMapDataset(images), MMapDataset(built["images"])
    assert len(remote) == len(local) and remote.classes == local.classes
    for a, b in zip(Loader(remote, 8, seed=3), Loader(local, 8, seed=3)):
        assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
    x, _ = next(iter(Loader(TokenWindows(text, 32), 4, seed=1)))
    y, _ = next(iter(Loader(TokenWindows(built["text"], 32), 4, seed=1)))
    assert torch.equal(x, y)


def _open_and_count(url: str, cache: str, out) -> None:
    out.put(len(MMapDataset(url, cache_dir=cache)))


def test_processes_opening_one_url_at_once_download_it_once(s3, built, tmp_path):
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    cache = tmp_path / "shared-cache"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_open_and_count, args=(url, str(cache), out)) for _ in range(3)]
    for p in procs:
        p.start()
    counts = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert counts == [len(MMapDataset(built["images"]))] * 3
    assert len([d for d in (cache / "mmpack").iterdir() if d.is_dir()]) == 1  # one copy in the cache


def test_a_pointer_past_its_bound_is_refused_unread(s3, built, tmp_path, monkeypatch):
    from packer.dataset import archive

    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    monkeypatch.setattr(archive, "ARCHIVE_JSON_BYTES", 100)  # a manifest.json (or archive.json) over it
    with pytest.raises(IntegrityError, match="not an mmpack manifest.json"):
        MMapDataset(url)


def test_a_reader_keeps_the_build_it_opened_when_a_new_one_is_pushed(s3, built, tmp_path):
    url = _url(tmp_path, "ds")
    assert main(["push", str(built["images"]), url]) == 0
    ds = MMapDataset(url)
    first = np.asarray(ds[0]["image"]).copy()
    assert main(["push", str(built["pairs"]), url]) == 0  # another dataset at the same URL
    assert np.array_equal(np.asarray(ds[0]["image"]), first) and "label" in ds.columns
    assert "tokens" in MMapDataset(url).columns  # a new open reads the new one


def test_opening_a_url_fetches_its_index_only_and_a_read_its_shard_only(s3, built, tmp_path):
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    ds, local = MMapDataset(url), MMapDataset(built["images"])
    assert ds.bytes_downloaded == 0
    assert ds[0]["key"] == local[0]["key"] and torch.equal(ds[0]["image"], local[0]["image"])
    assert ds.bytes_downloaded == local.manifest.shards[0].size_bytes - sum(
        f.size_bytes for f in local.manifest.shards[0].files if "offsets" in f.path or "shapes" in f.path)


def test_info_of_a_url_reads_its_manifest_alone_and_names_the_url(s3, built, tmp_path, capsys):
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    capsys.readouterr()
    assert main(["info", url]) == 0
    out = capsys.readouterr().out
    assert f"dataset   {url} " in out and f"{len(MMapDataset(built['images'])):,} in" in out
    assert not (tmp_path / "cache").exists()  # no shard, no index file downloaded
