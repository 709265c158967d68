"""Whole files between a dataset dir and object storage: `push` a finished dataset dir, `pull`
one, and fetch one file verified (what the node cache does per shard).

The object layout is the dataset dir's own (FORMAT.md): every file the manifest lists under its
generation dirs, the generation's copy of the manifest, and `manifest.json` at the prefix, put
last, so a reader sees the old dataset or the new one. Every file is verified: after an upload
by its size and the checksum recorded with it as the object's metadata (`mmpack-checksum`; on
Azure `mmpack_checksum`, whose metadata names take no hyphen:
what a push run again compares, so it repairs an object that differs), after a download by the
manifest's checksum (fetched once more on a mismatch, then
an IntegrityError naming the URL), and it lands by rename, so a kill leaves nothing partial that
a later reader would use. A reader pins the generation of the manifest it read.

`push(..., zstd=LEVEL)` (or the push of an archive dir, `packer pack`'s) publishes the archive
form instead: each file as one zstd frame `F.zst` and `archive.json` last (the manifest and each
compressed file's size and checksum), for fewer bytes over the link. A reader reads
`manifest.json`, else `archive.json`, and decompresses into its cache, checking the compressed
bytes and the restored ones; a frame that expands past the manifest's size is refused there.
A push of one form removes the other's pointer after it put its own.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packer.dataset import archive
from packer.dataset import format as fmt
from packer.dataset.outdir import write_atomic
from packer.dataset.reader import DatasetReader
from packer.dataset.writer import checksum_file, file_digest
from packer.errors import ConfigError, IntegrityError
from packer.remote import blocks, client
from packer.remote.url import Remote
from packer.system import flock

DOWNLOADS = 8  # files fetched at once: one GET's latency hidden behind the others
RANGE_BYTES = 32 * 2**20  # a larger file comes in ranges of this size, RANGES at once: a single
RANGES = 4  # stream's rate is often a fraction of the link's (the first batch of a large shard waits on it)
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mmpack" / "remote"
CHECKSUM_KEY = "mmpack-checksum"  # the object's user metadata: the checksum of what was pushed, algo:hex
# Azure's metadata names are C# identifiers: a hyphen is refused ("InvalidMetadata"), so every
# push to az:// failed with the S3 name
AZURE_CHECKSUM_KEY = "mmpack_checksum"


def checksum_key(remote: Remote) -> str:
    return AZURE_CHECKSUM_KEY if remote.scheme == "az://" else CHECKSUM_KEY


def _whole(path: Path) -> tuple[int, str]:
    """(size, checksum) of a small file read whole (a generation's copy of the manifest)."""
    data = path.read_bytes()
    digest = fmt.new_checksum()
    digest.update(data)
    return len(data), f"xxh3_128:{digest.hexdigest()}"


def files_of(manifest: fmt.Manifest) -> list[fmt.FileEntry]:
    files = [f for s in manifest.shards for f in s.files]
    return files + ([manifest.inputs] if manifest.inputs is not None else [])


def push_staging(url: str) -> Path:
    """Where `push --zstd` packs for `url` before uploading (this node's cache, one dir a URL)."""
    return DEFAULT_CACHE.parent / "push" / hashlib.sha256(url.encode()).hexdigest()[:16]


def push(out: str | Path, url: str, *, zstd: int | None = None) -> fmt.Manifest:
    """Upload the dataset dir `out` to `url`: its files (those the store holds with the same
    content kept: a killed push run again goes on, and one run again repairs any object that
    differs), each checked after upload, then the manifest last.
    `zstd` (a level), or `out` an archive dir: the archive form (see the module)."""
    Remote(url)  # a URL no store of ours serves is refused before anything is packed or read
    if (Path(out) / fmt.ARCHIVE_NAME).is_file():
        return _push_archive(Path(out), url)
    if zstd is not None:  # packed where a killed push run again packs it anew, then removed
        staging = push_staging(url)
        staging.mkdir(parents=True, exist_ok=True)
        with open(staging / ".push.lock", "a") as lock:
            flock(lock)  # one push of this URL at a time packs here
            # a push killed while packing left a part of an archive (no archive.json yet): ours
            # to remove under the lock, which `pack` rightly refuses to do to a dir it did not make
            shutil.rmtree(staging / "archive", ignore_errors=True)
            archive.pack(out, staging / "archive", level=zstd)
            pushed = _push_archive(staging / "archive", url)
            shutil.rmtree(staging / "archive")
        return pushed
    reader = DatasetReader(out)
    manifest, root = reader.manifest, reader.root
    generations = sorted({f.path.split("/", 1)[0] for f in files_of(manifest) if "/" in f.path})
    uploads = [(f.path, f.size_bytes, f"{f.algo}:{f.checksum}") for f in files_of(manifest)]
    uploads += [(f"{g}/{fmt.MANIFEST_NAME}", *_whole(root / g / fmt.MANIFEST_NAME)) for g in generations
                if (root / g / fmt.MANIFEST_NAME).is_file()]
    uploads += block_lists(manifest, root)
    _publish(Remote(url), root, uploads, fmt.MANIFEST_NAME, manifest.to_json())
    return manifest


def block_lists(manifest: fmt.Manifest, root: Path) -> list[tuple]:
    """The block list of each file a reader reads by rows (`blocks.ranged`), as uploads: its
    size, its checksum (the file's own: FORMAT.md 9) and its bytes, made only where the store
    lacks it (a push run again reads no file for one it holds)."""
    block = blocks.ranged(manifest)

    def made(entry: fmt.FileEntry):
        def read() -> bytes:
            digest = file_digest(root / entry.path, fmt.FileChecksum(keep=True))
            if digest.hexdigest() != entry.checksum:
                raise IntegrityError(f"{root / entry.path}: its bytes do not match the manifest's checksum; run "
                                     f"'packer verify {root}' before pushing it")
            return digest.digests()
        return read
    return [(e.path + blocks.BLOCKS, blocks.DIGEST * blocks.num_blocks(e.size_bytes, block[e.path]), f"xxh3_128:{e.checksum}",
             made(e)) for s in manifest.shards for e in s.files if e.path in block]


def _push_archive(root: Path, url: str) -> fmt.Manifest:
    raw = archive.description(root)  # read once: parsed here, pushed as it is
    manifest, files = archive.parse(root, raw)
    _publish(Remote(url), root, [(f.path, f.size_bytes, f"xxh3_128:{f.xxh3_128}") for f in files], fmt.ARCHIVE_NAME,
             raw.decode("utf-8"))
    return manifest


def _holds(obs, store, key: str, size: int, checksum: str, name: str) -> bool:
    """Whether the store holds `key` with these bytes: its size, and the checksum recorded with
    it (as metadata `name`) when it was pushed (an object pushed without one, or damaged since,
    is pushed again)."""
    got = client.head(obs, store, key)
    return got is not None and got.meta["size"] == size and got.attributes.get(name) == checksum


def _publish(remote: Remote, root: Path, uploads: list[tuple], pointer: str, doc: str) -> None:
    """`uploads` (path, size, checksum[, a function giving its bytes]) from `root`, each unless the store holds it with that
    content already and checked after upload, then `doc` as `pointer`, then the other form's
    pointer removed: a reader sees the old dataset or the new one."""
    obs = client.obstore(remote)
    store = client.store(remote)
    name = checksum_key(remote)
    for path, size, checksum, *made in uploads:
        with client.errors(remote, f"upload {path}"):
            if _holds(obs, store, remote.key(path), size, checksum, name):
                continue
            if made:  # bytes made for the store (a block list), not a file of the dir
                client.put(obs, store, remote.key(path), made[0](), attributes={name: checksum})
            else:
                with open(root / path, "rb") as f:
                    client.put(obs, store, remote.key(path), f, attributes={name: checksum})
            if not _holds(obs, store, remote.key(path), size, checksum, name):
                raise IntegrityError(f"{remote.where(path)}: uploaded, but the store holds another object; push again")
    with client.errors(remote, f"upload {pointer}"):
        client.put(obs, store, remote.key(pointer), doc.encode())
    other = fmt.ARCHIVE_NAME if pointer == fmt.MANIFEST_NAME else fmt.MANIFEST_NAME
    with client.errors(remote, f"remove the earlier {other}"):
        if client.size(obs, store, remote.key(other)) is not None:
            client.request(lambda: obs.delete(store, remote.key(other)))


def read_manifest(url: str) -> fmt.Manifest:
    return read_published(url)[0]


def read_published(url: str) -> tuple[fmt.Manifest, dict | None]:
    """The dataset at `url`: its manifest, and for the archive form the compressed file
    (`fmt.ArchiveFile`) of each of its files by path, else None."""
    remote = Remote(url)
    if not client.fork_safe():
        reply = client.Helper.get().call({"op": "manifest", "url": url})
        name, text = reply["name"], reply["text"]
    else:
        name, text = read_pointer(remote)
    if name == fmt.MANIFEST_NAME:
        return fmt.Manifest.from_json(text, where=remote.where(name)), None
    manifest, files = fmt.archive_from_json(text, where=remote.where(name))
    return manifest, {f.of: f for f in files}


def read_pointer(remote: Remote) -> tuple[str, str]:
    """(name, text) of `manifest.json`, else of `archive.json`."""
    obs = client.obstore(remote)
    store = client.store(remote)

    def text(name: str) -> str:
        def whole(got) -> str:
            if got.meta["size"] > archive.ARCHIVE_JSON_BYTES:  # not one of ours: not read into memory
                raise IntegrityError(f"{remote.where(name)}: over {archive.ARCHIVE_JSON_BYTES:,} bytes; not an mmpack "
                                     f"{name}")
            return bytes(got.bytes()).decode("utf-8")
        return client.read(obs, store, remote.key(name), whole)
    with client.errors(remote, "read the manifest"):
        try:
            return fmt.MANIFEST_NAME, text(fmt.MANIFEST_NAME)
        except Exception as exc:  # noqa: BLE001 - the archive form's pointer, else this error
            if not client.not_found(exc):
                raise
            try:
                return fmt.ARCHIVE_NAME, text(fmt.ARCHIVE_NAME)
            except Exception as other:  # noqa: BLE001
                if client.not_found(other):  # no dataset here: a wrong URL, not a damaged dataset
                    raise ConfigError(f"{remote.url}: no mmpack dataset there (neither {fmt.MANIFEST_NAME} nor "
                                      f"{fmt.ARCHIVE_NAME}, or no such bucket); check the URL, or packer push one "
                                      "there") from None
                raise


def pull(url: str, out: str | Path, *, published: tuple[fmt.Manifest, dict | None] | None = None,
         files: list[fmt.FileEntry] | None = None) -> fmt.Manifest:
    """Download the dataset at `url` (`published`: as `read_published` gave it) into the dir
    `out` (made complete, or left without its manifest): every file (or those of `files`)
    verified by the manifest's checksum, the manifest written last."""
    manifest, packed = published or read_published(url)
    out = Path(out)
    # one client, made where it is used (not in a forked child)
    store = functools.cache(functools.partial(client.store, Remote(url)))
    with ThreadPoolExecutor(DOWNLOADS) as pool:  # obstore's GETs release the GIL while they wait
        for done in [pool.submit(fetch_file, store, url, entry, out / entry.path, packed=(packed or {}).get(entry.path))
                     for entry in (files_of(manifest) if files is None else files)]:
            done.result()
    for g in sorted({e.path.split("/", 1)[0] for e in files_of(manifest) if "/" in e.path}):
        (out / g).mkdir(parents=True, exist_ok=True)
        write_atomic(out / g / fmt.MANIFEST_NAME, manifest.to_json())
        (out / g / fmt.READERS_LOCK).touch()
    write_atomic(out / fmt.MANIFEST_NAME, manifest.to_json())
    return manifest


def fetch_verified(obs, store, remote: Remote, entry: fmt.FileEntry, target: Path, temp=None,
                   packed: fmt.ArchiveFile | None = None) -> int:
    """One file into `target`, verified by the manifest's checksum (kept when it is there and
    whole already); a mismatch is fetched once more, then refused naming the object. `temp`: an
    open part file to write it in (the cache's, reserved at its size), left there verified for
    the caller to rename; else one made here, renamed to `target`. `packed`: the file comes as
    that compressed object (the archive form), decompressed as it arrives. Returns the GET
    requests it made (a range is one; the client's own retries are not counted)."""
    if temp is None and target.is_file() and target.stat().st_size == entry.size_bytes and \
            checksum_file(target, entry.algo) == entry.checksum:
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    own = temp is None
    f = open(target.with_name(f".{target.name}.part-{os.getpid()}"), "w+b") if own else temp
    gets = 0
    try:
        new_digest(remote, entry)  # (an algorithm this mmpack does not know: refused before any request)
        for _ in (1, 2):
            with client.errors(remote, f"download {(packed or entry).path}"):
                if entry.size_bytes > RANGE_BYTES and packed is None:
                    gets += -(-entry.size_bytes // RANGE_BYTES)
                    digest = new_digest(remote, entry)
                    whole = _get_ranges(obs, store, remote.key(entry.path), f, entry.size_bytes, digest)
                else:
                    gets += 1
                    whole, digest = read_whole(obs, store, remote, entry, f, packed)
            f.truncate()
            f.flush()
            if whole and f.tell() == entry.size_bytes and digest.hexdigest() == entry.checksum:
                if own:
                    os.replace(f.name, target)
                return gets
    finally:
        if own:
            f.close()
            Path(f.name).unlink(missing_ok=True)
    raise IntegrityError(f"{remote.where((packed or entry).path)}: its bytes do not match the checksum "
                         f"{'archive.json and ' if packed else ''}the manifest records (fetched twice); the remote "
                         "dataset is damaged: push it again")


def new_digest(remote: Remote, entry: fmt.FileEntry):
    """A hasher of the manifest's algorithm for `entry`, or one line saying this mmpack lacks it."""
    digest = fmt.hasher(entry.algo)
    if digest is None:
        raise IntegrityError(f"{remote.where(entry.path)}: checksum algorithm {entry.algo!r} is not known to "
                             "this mmpack; use the release that wrote it, or a newer one")
    return digest


def read_whole(obs, store, remote: Remote, entry: fmt.FileEntry, f, packed: fmt.ArchiveFile | None = None):
    """`entry`'s object (or its compressed one, `packed`) in one GET, written to `f` from its
    start (None: hashed, kept nowhere) and hashed as it arrives: (whether it came whole and no
    longer than the manifest says, the digest of what came). A body cut off mid-way is read
    again from its start (`client.read`), with a fresh digest."""
    def once(stream):
        if f is not None:
            f.seek(0)
        digest = new_digest(remote, entry)  # hashed as it arrives: no second read of the file
        if packed is not None:
            return read_zstd(stream, remote, packed, f, digest, entry.size_bytes), digest
        return read_stream(stream, f, entry.size_bytes, digest) == entry.size_bytes, digest
    return client.read(obs, store, remote.key((packed or entry).path), once)


def read_zstd(chunks, remote: Remote, packed: fmt.ArchiveFile, f, digest, size: int) -> bool:
    """The compressed object `packed` (its stream, `chunks`) decompressed into `f` (None: hashed,
    kept nowhere) and hashed by `digest` as it arrives; whether its compressed bytes are the ones
    archive.json records. Past its compressed size, or past `size` restored bytes (the
    manifest's), it stops: a frame that expands without end fills no disk."""
    import zstandard

    wire, got = fmt.new_checksum(), 0
    restored = archive.Hashing(f, lambda: digest, limit=size, where=remote.where(packed.path))
    try:
        with zstandard.ZstdDecompressor().stream_writer(restored, closefd=False) as sink:
            for chunk in chunks:
                got += len(chunk)
                if got > packed.size_bytes:
                    return False
                wire.update(chunk)
                sink.write(chunk)
    except (zstandard.ZstdError, IntegrityError):  # damaged on the way or at rest: fetched again, then refused
        return False
    return got == packed.size_bytes and wire.hexdigest() == packed.xxh3_128


def read_stream(chunks, f, size: int, digest) -> int | None:
    """An object's stream written to `f` (None: hashed, kept nowhere) and hashed, stopping past
    `size` bytes (the manifest's): an object longer than its entry fills no disk. The bytes it
    held; None when it was longer."""
    got = 0
    for chunk in chunks:
        got += len(chunk)
        if got > size:
            return None
        if f is not None:
            f.write(chunk)
        digest.update(chunk)
    return got


def _get_ranges(obs, store, key: str, f, size: int, digest) -> bool:
    """The object's bytes written at their offsets in `f`, RANGES ranged GETs at once, each read
    as a stream and stopped at its range's length (an answer longer than it asked for is never
    buffered whole), then hashed in order from the file (the page cache), `f` left at its end.
    A range that comes back short leaves bytes that fail the checksum, as a torn stream does;
    False when one came back longer."""
    def one(start: int) -> bool:
        return _read_range(obs, store, key, f.fileno(), start, min(start + RANGE_BYTES, size))
    with ThreadPoolExecutor(RANGES) as pool:
        fits = all(list(pool.map(one, range(0, size, RANGE_BYTES))))
    for start in range(0, size, RANGE_BYTES):
        digest.update(os.pread(f.fileno(), min(RANGE_BYTES, size - start), start))
    f.seek(size)
    return fits


def _read_range(obs, store, key: str, fd: int, start: int, end: int) -> bool:
    """Bytes [start, end) of the object written at the same offsets of `fd`, read as a stream
    and stopped at the range's end: False when the answer was longer (never buffered whole). A
    body cut off mid-way is read again (`client.read`): the same bytes at the same offsets."""
    def once(stream) -> bool:
        at = start
        for chunk in stream:
            if at + len(chunk) > end:
                return False
            os.pwrite(fd, memoryview(chunk), at)
            at += len(chunk)
        return True
    return client.read(obs, store, key, once, options={"range": (start, end)})


def get_range(store_of, url: str, path: str, start: int, end: int, target: Path) -> bool:
    """Bytes [start, end) of the object at `path` written at the same offsets of the file
    `target` (here, or by the helper in a process forked after a request), read as a stream and
    stopped at the range's end: False when the answer was longer (a short one leaves bytes the
    caller's check refuses)."""
    if not client.fork_safe():
        return client.Helper.get().call({"op": "range", "url": url, "path": path, "start": start, "end": end,
                                         "target": str(target)})["fits"]
    remote = Remote(url)
    with client.errors(remote, f"download {path}"), open(target, "r+b") as f:
        return _read_range(client.obstore(remote), store_of(), remote.key(path), f.fileno(), start, end)


def get_small(store_of, url: str, path: str, size: int) -> bytes | None:
    """The object at `path`, expected to be `size` bytes (a block list): None where there is
    none, or where it is longer (never buffered past `size`)."""
    if not client.fork_safe():
        got = client.Helper.get().call({"op": "small", "url": url, "path": path, "size": size})["hex"]
        return None if got is None else bytes.fromhex(got)
    remote = Remote(url)

    def once(stream) -> bytes | None:  # (a body cut off mid-way: read again into a fresh buffer)
        out = io.BytesIO()
        return None if read_stream(stream, out, size, fmt.new_checksum()) is None else out.getvalue()
    with client.errors(remote, f"download {path}"):
        try:
            return client.read(client.obstore(remote), store_of(), remote.key(path), once)
        except Exception as exc:  # noqa: BLE001 - obstore's NotFound has its own class per version
            if client.not_found(exc):
                return None
            raise


def fetch_file(store_of, url: str, entry: fmt.FileEntry, target: Path, temp=None,
               packed: fmt.ArchiveFile | None = None) -> int:
    """`fetch_verified` here (`store_of()`: this process's client), or, in a process forked after
    a request, by the helper; the GET requests it made."""
    if client.fork_safe():
        return fetch_verified(client.obstore(Remote(url)), store_of(), Remote(url), entry, target, temp=temp,
                              packed=packed)
    return client.Helper.get().call({"op": "fetch", "url": url, "entry": entry.to_json(), "target": str(target),
                                     "temp": temp.name if temp is not None else None,
                                     "packed": dataclasses.asdict(packed) if packed is not None else None})["gets"]
