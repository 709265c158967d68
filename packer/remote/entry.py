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
from packer.dataset.outdir import write_atomic
from packer.errors import ConfigError, IntegrityError
from packer.remote.cache import ShardCache
from packer.remote.limits import check_limit
from packer.remote.rows import Rows, drop_dead
from packer.remote.stamps import recheck, unchanged
from packer.remote import transfer
from packer.remote.transfer import fetch_file, files_of, pull, read_published
from packer.remote import placement
from packer.remote.url import Remote
from packer.system import flock


def entry_dir(url: str, manifest: fmt.Manifest, cache_dir: str | Path | None) -> Path:
    """The cache dir of the build `manifest` at `url`: a push after this open is another one."""
    digest = hashlib.sha256(f"{url}\0{manifest.generation}\0{manifest.to_json()}".encode()).hexdigest()[:16]
    if cache_dir:
        base = Path(cache_dir)
        placement.check(base)
    else:
        base = placement.node_local(transfer.DEFAULT_CACHE)
    return base / Remote(url).bucket / digest


def build_dir(url: str) -> Path:
    """Where `packer build RAW URL` builds before it pushes: one local dir per URL."""
    return transfer.DEFAULT_CACHE.parent / "builds" / hashlib.sha256(url.encode()).hexdigest()[:16]


def open_cached(url: str, cache_dir: str | Path | None = None, limit: int | None = None, *,
                published: tuple[fmt.Manifest, dict | None] | None = None) -> ShardCache:
    """The node's cache entry of the dataset at `url`, made with its manifest and index files on
    first open (the processes of every rank wait for the first one); its other files come per
    shard as readers need them. Pinned to the manifest read now (`published`: what
    `read_published` gave the caller): a push after this open is another entry."""
    manifest, packed = published or read_published(url)
    root = entry_dir(url, manifest, cache_dir)
    cache = ShardCache(url, root, manifest, limit, packed)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only (or foreign) cache dir without this dataset
        raise _unwritable(url, root, exc) from None
    cache.here()  # held by this process from now on: never removed whole while it is open
    need = cache.index_bytes + max(cache.sizes, default=0)
    if limit is not None and limit < cache.index_bytes:
        check_limit(url, limit, need, "the dataset's index files and its largest shard", limit=limit)
    _open_entry(url, root, cache, manifest, packed)
    if os.access(root, os.W_OK) and drop_dead(root)[1]:  # a killed reader's rows: its reservation leaves the ledger
        with cache.accounting() as ledger:
            ledger.recount()
    if limit is not None and limit < need and not Rows(cache).usable():
        # below a shard, only reads by rows serve (a Loader's or ds.batched's batches)
        check_limit(url, limit, need, "the dataset's index files and its largest shard", limit=limit)
    return cache


def index_unchanged(cache: ShardCache) -> bool:
    """Whether the entry's index files are as their stamps say (`packer.remote.stamps`): a stat each."""
    return all(unchanged(cache.root, files) for files in _by_dir(cache.index).values())


def check_index(cache: ShardCache, every: bool = False) -> list[fmt.FileEntry]:
    """The entry's index files (mapped whole at every open) whose stamp differs (`every`: all
    of them) hashed again, and those that no longer match fetched again (the creation lock
    held by the caller); the ones fetched again. In a read-only cache, an IntegrityError."""
    fetched = []
    for files in _by_dir(cache.index).values():
        _, bad = recheck(cache.root, files, every)
        for entry in bad:
            path = cache.root / entry.path
            if not os.access(path.parent, os.W_OK):
                raise IntegrityError(f"{path}: this cached file no longer matches its checksum, and the cache is "
                                     "read-only; fetch it again where the cache can be written")
            path.unlink()
            fetch_file(cache.store, cache.url, entry, path)
            recheck(cache.root, [entry], every=True)  # its stamp
            fetched.append(entry)
    return fetched


def _by_dir(entries: list[fmt.FileEntry]) -> dict[str, list[fmt.FileEntry]]:
    out: dict = {}
    for e in entries:
        out.setdefault(e.path.rsplit("/", 1)[0], []).append(e)
    return out


def _open_entry(url: str, root: Path, cache: ShardCache, manifest: fmt.Manifest, packed) -> ShardCache:
    """The entry made (or checked) with its manifest and index files (see `open_cached`)."""
    if (root / fmt.MANIFEST_NAME).is_file():
        if index_unchanged(cache) and not _changed_manifests(root, manifest):
            return cache
        if not os.access(root.parent, os.W_OK):  # a read-only cache: checked, never fetched into
            if _changed_manifests(root, manifest):
                raise IntegrityError(f"{root}: its manifest is not the one {url} publishes, and the cache is "
                                     "read-only; fetch it again where the cache can be written")
            check_index(cache)
            return cache
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root.parent / f".{root.name}.lock", "a")
    except OSError as exc:  # a read-only cache that holds other builds, not this one
        raise _unwritable(url, root, exc) from None
    with lock:
        flock(lock)
        if (root / fmt.MANIFEST_NAME).is_file():
            check_index(cache)  # an index file changed since it was checked: hashed, fetched again if it differs
            for path in _changed_manifests(root, manifest):  # a copy written over: the store's again
                write_atomic(path, manifest.to_json())
        else:
            try:
                pull(url, root, published=(manifest, packed), files=cache.index)
            except BaseException:
                if not (root / fmt.MANIFEST_NAME).is_file():
                    shutil.rmtree(root, ignore_errors=True)
                raise
            check_index(cache, every=True)  # their stamps
    return cache


def _unwritable(url: str, root: Path, exc: OSError) -> ConfigError:
    """The one line for a cache dir this process cannot write that lacks this build."""
    return ConfigError(f"{url}: the cache dir {root.parent.parent} holds no copy of this build and cannot be written "
                       f"({exc.strerror or exc}); give a cache_dir this process can write (a read-only cache is read "
                       "once it was filled where it could be written)")


def _changed_manifests(root: Path, manifest: fmt.Manifest) -> list[Path]:
    """The entry's copies of its manifest (its own and each generation's, which readers open)
    that are not the store's, as read at this open (its name is the digest of that one)."""
    text = manifest.to_json()
    generations = sorted({e.path.split("/", 1)[0] for e in files_of(manifest) if "/" in e.path})  # as `pull` writes
    copies = [root / fmt.MANIFEST_NAME] + [root / g / fmt.MANIFEST_NAME for g in generations]
    changed = []
    for path in copies:
        try:
            if path.read_text(encoding="utf-8") != text:
                changed.append(path)
        except (OSError, UnicodeDecodeError):
            changed.append(path)
    return changed


def materialize(url: str, cache_dir: str | Path | None = None) -> Path:
    """The whole dataset at `url` in the node's cache (see `open_cached`), and that dir."""
    cache = open_cached(url, cache_dir)
    cache.fetch(range(len(cache.bulk)))
    inputs = cache.manifest.inputs  # the build's record of its inputs: `packer verify` checks it, readers never read it
    if inputs is not None:  # (the archive form has none)
        fetch_file(cache.store, url, inputs, cache.root / inputs.path)
    return cache.root
