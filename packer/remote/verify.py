"""`packer verify URL`: every object of a dataset in object storage hashed as the store holds it,
against the checksums the manifest records (and archive.json's, for a compressed push), files
DOWNLOADS at once, each read as a stream that stops at the manifest's size: the bytes a reader
would get, never the node's cache (which `packer verify` of a cache dir checks)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from packer.dataset import archive
from packer.dataset import format as fmt
from packer.errors import IntegrityError
from packer.remote import client
from packer.remote.transfer import DOWNLOADS, files_of, read_published
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
        with client.errors(remote, f"verify {(compressed or entry).path}"):
            if compressed is not None:
                _check_packed(obs, store, remote, compressed, entry)
            else:
                _check_plain(obs, store, remote, entry)
        done.append(entry)
        if on_progress:
            on_progress(len(done), len(entries))

    with ThreadPoolExecutor(DOWNLOADS) as pool:
        list(pool.map(one, entries))
    return {"files": len(entries), "size_bytes": manifest.size_bytes, "num_samples": manifest.num_samples}


def _check_plain(obs, store, remote: Remote, entry: fmt.FileEntry) -> None:
    digest, got = fmt.hasher(entry.algo), 0
    if digest is None:
        raise IntegrityError(f"{remote.where(entry.path)}: checksum algorithm {entry.algo!r} is not known to this "
                             "mmpack; use the release that wrote it, or a newer one")
    for chunk in obs.get(store, remote.key(entry.path)):
        got += len(chunk)
        if got > entry.size_bytes:  # no byte past the manifest's size is read on
            raise IntegrityError(f"{remote.where(entry.path)}: holds more than the {entry.size_bytes:,} bytes the "
                                 "manifest records; the dataset in the store is damaged: push it again")
        digest.update(chunk)
    if got != entry.size_bytes or digest.hexdigest() != entry.checksum:
        what = f"{got:,} bytes, the manifest records {entry.size_bytes:,}" if got != entry.size_bytes else \
            "its bytes do not match the checksum the manifest records"
        raise IntegrityError(f"{remote.where(entry.path)}: {what}; the dataset in the store is damaged: push it again")


def _check_packed(obs, store, remote: Remote, packed: fmt.ArchiveFile, entry: fmt.FileEntry) -> None:
    import zstandard

    wire, got = fmt.new_checksum(), 0
    restored = archive._Hashing(None, lambda: fmt.hasher(entry.algo), limit=entry.size_bytes,
                                where=remote.where(packed.path))  # hashed, kept nowhere
    try:
        with zstandard.ZstdDecompressor().stream_writer(restored, closefd=False) as sink:
            for chunk in obs.get(store, remote.key(packed.path)):
                got += len(chunk)
                if got > packed.size_bytes:
                    raise IntegrityError(f"{remote.where(packed.path)}: holds more than the {packed.size_bytes:,} "
                                         "bytes archive.json records; push it again")
                wire.update(chunk)
                sink.write(chunk)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{remote.where(packed.path)}: not a zstd frame ({exc}); push it again") from None
    if got != packed.size_bytes or wire.hexdigest() != packed.xxh3_128 or \
            restored.digest.hexdigest() != entry.checksum:
        raise IntegrityError(f"{remote.where(packed.path)}: its bytes do not match the checksums archive.json and "
                             "the manifest record; the dataset in the store is damaged: push it again")
