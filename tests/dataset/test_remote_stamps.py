"""Stamps of cached files (packer.remote.stamps): a file changed since it was fetched is hashed
again and fetched again."""

from __future__ import annotations

from pathlib import Path

import torch

from loaders import MMapDataset
from packer.cli import main
from packer.dataset import format as fmt

from .remote import NEEDS_SERVER, _same_batches, _url

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


def test_a_cached_file_changed_since_it_was_fetched_is_hashed_again_and_fetched_again(s3, built, tmp_path):
    """A byte written over a cached file (by any process) changes its stamp (size, times,
    inode): the next process to map it hashes it again and, as it no longer matches, fetches it
    again; a cache from before stamps is hashed once and stamped."""
    url, cache = _url(tmp_path, "images"), tmp_path / "c"
    assert main(["push", str(built["images"]), url]) == 0
    local = MMapDataset(built["images"])
    _same_batches(MMapDataset(url, cache_dir=cache), local)
    cached = sorted(cache.rglob("image.npy"))
    assert len(cached) == len(local.manifest.shards) and all((p.parent / ".verified").is_file() for p in cached)
    with open(cached[1], "r+b") as f:  # a byte of a sample's pixels, well past the header
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    for p in cached[2:]:  # and these as a cache written before stamps
        (p.parent / ".verified").unlink()
    ds = MMapDataset(url, cache_dir=cache)
    _same_batches(ds, local)
    assert ds.bytes_downloaded == cached[1].stat().st_size  # the changed file alone came again
    entry = cached[1].relative_to(cache).parts[2:]  # under the cache's <bucket>/<entry>/
    assert cached[1].read_bytes() == Path(built["images"], *entry).read_bytes()
    assert all((p.parent / ".verified").is_file() for p in cached)


def test_a_cached_index_file_changed_since_it_was_fetched_is_fetched_again_at_the_next_open(s3, built, tmp_path):
    """A ragged column's offsets (an index file, mapped whole by every open) with a byte written
    over them: the next open hashes it again and fetches it again, and every sample's tokens are
    the local ones (else they would come from the wrong ranges, silently)."""
    url, cache = _url(tmp_path, "pairs"), tmp_path / "c"
    assert main(["push", str(built["pairs"]), url]) == 0
    local = MMapDataset(built["pairs"])

    def same(ds) -> None:
        for i in range(len(local)):
            a, b = ds[i], local[i]
            assert a["key"] == b["key"] and torch.equal(a["tokens"], b["tokens"]), i

    same(MMapDataset(url, cache_dir=cache))
    offsets = sorted(p for p in cache.rglob("*.npy") if "tokens" in p.name and "offsets" in p.name)[0]
    with open(offsets, "r+b") as f:  # the second offset's low byte: the first sample's end
        f.seek(fmt.NPY_HEADER_BYTES + 8)
        byte = f.read(1)
        f.seek(fmt.NPY_HEADER_BYTES + 8)
        f.write(bytes([byte[0] ^ 0x01]))
    same(MMapDataset(url, cache_dir=cache))
    entry = offsets.relative_to(cache).parts[2:]
    assert offsets.read_bytes() == Path(built["pairs"], *entry).read_bytes()
    # and the cached manifests (the entry's and its generation's), written over: the store's again
    copies = sorted(cache.rglob(fmt.MANIFEST_NAME))
    assert len(copies) >= 2
    for copy in copies:
        copy.write_text(copy.read_text().replace('"num_samples": ', '"num_samples": 1', 1))
    same(MMapDataset(url, cache_dir=cache))
    assert all(copy.read_text() == local.manifest.to_json() for copy in copies)
