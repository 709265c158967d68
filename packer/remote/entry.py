"""A dataset in object storage opened on this node: its entry in the node's cache, made with the
manifest and index files (offsets and shapes) on first open and shared by every process and
rank; the rest comes per shard (`packer.remote.cache.ShardCache`), or all of it at once
(`materialize`) for readers that map the whole dataset."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from packer.dataset import format as fmt
from packer.remote.cache import ShardCache
from packer.remote.limits import check_limit
from packer.remote import transfer
from packer.remote.transfer import fetch_file, pull, read_published
from packer.remote.url import Remote
from packer.system import flock


def entry_dir(url: str, manifest: fmt.Manifest, cache_dir: str | Path | None) -> Path:
    """The cache dir of the build `manifest` at `url`: a push after this open is another one."""
    digest = hashlib.sha256(f"{url}\0{manifest.generation}\0{manifest.to_json()}".encode()).hexdigest()[:16]
    return Path(cache_dir or transfer.DEFAULT_CACHE) / Remote(url).bucket / digest


def build_dir(url: str) -> Path:
    """Where `packer build RAW URL` builds before it pushes: one local dir per URL."""
    return transfer.DEFAULT_CACHE.parent / "builds" / hashlib.sha256(url.encode()).hexdigest()[:16]


def open_cached(url: str, cache_dir: str | Path | None = None, limit: int | None = None) -> ShardCache:
    """The node's cache entry of the dataset at `url`, made with its manifest and index files on
    first open (the processes of every rank wait for the first one); its other files come per
    shard as readers need them. Pinned to the manifest read now: a push after this open is
    another entry."""
    manifest, packed = read_published(url)
    root = entry_dir(url, manifest, cache_dir)
    cache = ShardCache(url, root, manifest, limit, packed)
    root.parent.mkdir(parents=True, exist_ok=True)
    cache._here()  # held by this process from now on: never removed whole while it is open
    if limit is not None:
        check_limit(url, limit, cache.index_bytes + max(cache.sizes, default=0),
                    "the dataset's index files and its largest shard", limit=limit)
    if (root / fmt.MANIFEST_NAME).is_file():
        if cache.index_unchanged():
            return cache
        if not os.access(root.parent, os.W_OK):  # a read-only cache: checked, never fetched into
            cache.check_index()
            return cache
    root.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "a") as lock:
        flock(lock)
        if (root / fmt.MANIFEST_NAME).is_file():
            cache.check_index()  # an index file changed since it was checked: hashed, fetched again if it differs
        else:
            try:
                pull(url, root, published=(manifest, packed), files=cache.index)
            except BaseException:
                if not (root / fmt.MANIFEST_NAME).is_file():
                    shutil.rmtree(root, ignore_errors=True)
                raise
            cache.check_index(every=True)  # their stamps
    return cache


def materialize(url: str, cache_dir: str | Path | None = None) -> Path:
    """The whole dataset at `url` in the node's cache (see `open_cached`), and that dir."""
    cache = open_cached(url, cache_dir)
    cache.fetch(range(len(cache.bulk)))
    inputs = cache.manifest.inputs  # the build's record of its inputs: `packer verify` checks it, readers never read it
    if inputs is not None:  # (the archive form has none)
        fetch_file(cache.store, url, inputs, cache.root / inputs.path)
    return cache.root
