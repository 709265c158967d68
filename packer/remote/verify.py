"""`packer verify URL`: every object of a dataset in object storage hashed as the store holds it,
against the checksums the manifest records (and archive.json's, for a compressed push), files
DOWNLOADS at once, each read as a stream that stops at the manifest's size (the reads a fetch
makes, `transfer`, with nothing kept): the bytes a reader would get, never the node's cache.
`packer verify URL --cache` checks that instead (`verify_cache`): the node's copies, repaired by
removing what no longer matches."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from packer.dataset import format as fmt
from packer.errors import IntegrityError
from packer.remote import client
from packer.remote.transfer import DOWNLOADS, files_of, new_digest, read_published, read_whole
from packer.remote.url import Remote


def verify(url: str, *, on_progress=None) -> dict:
    """{"files", "size_bytes", "num_samples"} when every object matches; an IntegrityError
    naming the first that does not (its size, or its checksum), or that is missing."""
    manifest, packed = read_published(url)
    remote = Remote(url)
    obs, store = client.obstore(remote), client.store(remote)
    entries = files_of(manifest)
    done = []

    def one(entry: fmt.FileEntry) -> None:
        compressed = (packed or {}).get(entry.path)
        new_digest(remote, entry)  # (an algorithm this mmpack does not know: refused before any request)
        with client.errors(remote, f"verify {(compressed or entry).path}"):
            whole, digest = read_whole(obs, store, remote, entry, None, compressed)
        if not whole or digest.hexdigest() != entry.checksum:
            raise IntegrityError(f"{remote.where((compressed or entry).path)}: its bytes do not match the checksum "
                                 f"{'archive.json and ' if compressed else ''}the manifest records; the dataset in "
                                 "the store is damaged: push it again")
        done.append(entry)
        if on_progress:
            on_progress(len(done), len(entries))

    with ThreadPoolExecutor(DOWNLOADS) as pool:
        list(pool.map(one, entries))
    return {"files": len(entries), "size_bytes": manifest.size_bytes, "num_samples": manifest.num_samples}


def verify_cache(url: str, cache_dir=None, *, on_progress=None) -> dict:
    """The node's cache of the dataset at `url` (its build published now): every file cached
    there hashed against the manifest; one that no longer matches is removed, to be fetched
    again by the next reader that needs it (an index file, which every open maps, at once).
    {"files", "size_bytes", "removed": [paths], "cache"}, with "empty" where nothing is cached."""
    from packer.remote.entry import check_index, entry_dir, open_cached

    published = read_published(url)
    root = entry_dir(url, published[0], cache_dir)
    if not (root / fmt.MANIFEST_NAME).is_file():  # none to check: not made here (an open would fetch its index)
        return {"files": 0, "size_bytes": 0, "removed": [], "cache": str(root), "empty": True}
    cache = open_cached(url, cache_dir, published=published)
    fetched = check_index(cache, every=True)
    checked, size = len(cache.index), sum(e.size_bytes for e in cache.index)
    removed = [e.path for e in fetched]
    for k in range(len(cache.bulk)):
        good, bad = cache.check(k)
        checked += len(good) + len(bad)
        size += sum(e.size_bytes for e in good + bad)
        removed += [e.path for e in bad]
        if on_progress:
            on_progress(k + 1, len(cache.bulk))
    return {"files": checked, "size_bytes": size, "removed": removed, "cache": str(cache.root)}
