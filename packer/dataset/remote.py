"""Datasets in object storage (`s3://bucket/prefix`, AWS or any S3-compatible endpoint, or
`az://container/prefix`, Azure Blob Storage): `push` a finished dataset dir, `pull` one, and
`materialize` one into a node-local cache for readers.

The object layout is the dataset dir's own (FORMAT.md): every file the manifest lists under its
generation dirs, the generation's copy of the manifest, and `manifest.json` at the prefix, put
last, so a reader sees the old dataset or the new one. Every file is verified: after an upload
by its size, after a download by the manifest's checksum (fetched once more on a mismatch, then
an IntegrityError naming the URL), and it lands by rename, so a kill leaves nothing partial that
a later reader would use. A reader pins the generation of the manifest it read.

`push(..., zstd=LEVEL)` (or the push of an archive dir, `packer pack`'s) publishes the archive
form instead: each file as one zstd frame `F.zst` and `archive.json` last (the manifest and each
compressed file's size and checksum), for fewer bytes over the link. A reader reads
`manifest.json`, else `archive.json`, and decompresses into its cache, checking the compressed
bytes and the restored ones; a frame that expands past the manifest's size is refused there.
A push of one form removes the other's pointer after it put its own.

Credentials and endpoint are the standard environment: for s3://, AWS_ENDPOINT_URL (or
AWS_ENDPOINT_URL_S3), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
AWS_REGION / AWS_DEFAULT_REGION; for az://, the client's AZURE_* variables (AZURE_STORAGE_ACCOUNT_NAME
with AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, a managed identity or the Azure CLI;
AZURE_STORAGE_ENDPOINT and AZURE_ALLOW_HTTP for an emulator). The client (obstore, the Rust
object_store) is made lazily in the process that uses it, never inherited by a fork.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from packer.dataset import format as fmt
from packer.dataset.outdir import write_atomic
from packer.dataset.writer import checksum_file
from packer.errors import ConfigError, IntegrityError
from packer.system import flock

SCHEMES = ("s3://", "az://")  # gs:// waits for a GCS server the tests can start (object_store speaks its XML API)
CREDENTIALS = {"s3://": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a non-AWS store)",
               "az://": "set AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY (or AZURE_STORAGE_SAS_TOKEN)"}
RETRIES = 10
DOWNLOADS = 8  # files fetched at once: one GET's latency hidden behind the others
RANGE_BYTES = 32 * 2**20  # a larger file comes in ranges of this size, RANGES at once: a single
RANGES = 4  # stream's rate is often a fraction of the link's (the first batch of a large shard waits on it)
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mmpack" / "remote"


# obstore's runtime (tokio) is not fork-safe: a process forked after its parent made a request
# hangs on its first own request, whatever client it makes. Such a process (a forked DataLoader
# worker) hands its requests to a helper it starts with exec (`Helper`), a fresh interpreter.
_used = False  # this process has made a request
_forked_after_use = False  # an ancestor had, before it forked this process


def _after_fork() -> None:
    global _forked_after_use
    _forked_after_use = _forked_after_use or _used


os.register_at_fork(after_in_child=_after_fork)


def fork_safe() -> bool:
    """Whether this process may use obstore itself (it was not forked from one that had)."""
    return not _forked_after_use


def is_url(path) -> bool:
    return isinstance(path, str) and path.startswith(SCHEMES)


@dataclass(frozen=True)
class Remote:
    """One dataset's place in object storage."""

    url: str

    @property
    def scheme(self) -> str:
        return self.url[:self.url.index("://") + 3]

    @property
    def bucket(self) -> str:
        """The bucket (s3://) or container (az://)."""
        return self.url[len(self.scheme):].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        rest = self.url[len(self.scheme):].split("/", 1)
        return rest[1].strip("/") if len(rest) > 1 else ""

    def key(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path

    def where(self, path: str) -> str:
        return f"{self.scheme}{self.bucket}/{self.key(path)}"

    def store(self):
        global _used
        _used = True
        try:
            from obstore.store import AzureStore, S3Store
        except ImportError:
            raise ConfigError(f"{self.scheme} datasets need obstore: pip install 'mmpack[remote]'") from None
        if not self.bucket:
            raise ConfigError(f"{self.url}: no bucket ({self.scheme}BUCKET/PREFIX)")
        # timeouts, resets and 5xx retried with exponential backoff and full jitter (the client's own)
        retry = {"max_retries": RETRIES, "retry_timeout": timedelta(minutes=3),
                 "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2}}
        if self.scheme == "az://":  # account, key or token, endpoint: the client's AZURE_* environment
            return AzureStore(self.bucket, retry_config=retry)
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        extra = {"endpoint": endpoint, "allow_http": endpoint.startswith("http://"),
                 "virtual_hosted_style_request": False} if endpoint else {}
        return S3Store(self.bucket, region=region, retry_config=retry, **extra)


def _errors(remote: Remote, what: str):
    """Runs `what` against the store; its errors as our one-line errors naming the URL."""

    class Guard:
        def __enter__(self):
            return self

        def __exit__(self, kind, exc, tb):
            if exc is None or isinstance(exc, (ConfigError, IntegrityError)):
                return False
            name = type(exc).__name__
            text = str(exc).splitlines()[0][:200] if str(exc) else name
            if _not_found(exc):
                raise IntegrityError(f"{remote.url}: {what}: not found ({text})") from None
            if "PermissionDenied" in name or "Unauthenticated" in name or any(
                    s in text for s in ("403", "Forbidden", "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId")):
                raise ConfigError(f"{remote.url}: {what}: access denied; {CREDENTIALS[remote.scheme]}") from None
            if isinstance(exc, OSError) or "Generic" in name or "Error" in name:
                raise ConfigError(f"{remote.url}: {what}: {text}") from None
            return False

    return Guard()


def _files(manifest: fmt.Manifest) -> list[fmt.FileEntry]:
    files = [f for s in manifest.shards for f in s.files]
    return files + ([manifest.inputs] if manifest.inputs is not None else [])


def push_staging(url: str) -> Path:
    """Where `push --zstd` packs for `url` before uploading (this node's cache, one dir a URL)."""
    return DEFAULT_CACHE.parent / "push" / hashlib.sha256(url.encode()).hexdigest()[:16]


def push(out: str | Path, url: str, *, zstd: int | None = None) -> fmt.Manifest:
    """Upload the dataset dir `out` to `url`: its files (those of the same size there already
    kept: a killed push run again goes on), each checked after upload, then the manifest last.
    `zstd` (a level), or `out` an archive dir: the archive form (see the module)."""
    from packer.dataset import archive

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
    from packer.dataset.reader import DatasetReader

    reader = DatasetReader(out)
    manifest, root = reader.manifest, reader.root
    generations = sorted({f.path.split("/", 1)[0] for f in _files(manifest) if "/" in f.path})
    uploads = [(f.path, f.size_bytes) for f in _files(manifest)]
    uploads += [(f"{g}/{fmt.MANIFEST_NAME}", (root / g / fmt.MANIFEST_NAME).stat().st_size) for g in generations
                if (root / g / fmt.MANIFEST_NAME).is_file()]
    _publish(Remote(url), root, uploads, fmt.MANIFEST_NAME, manifest.to_json())
    return manifest


def _push_archive(root: Path, url: str) -> fmt.Manifest:
    from packer.dataset import archive

    raw = archive._description(root)  # read once: parsed here, pushed as it is
    manifest, files = archive._parse(root, raw)
    _publish(Remote(url), root, [(f.path, f.size_bytes) for f in files], fmt.ARCHIVE_NAME, raw.decode("utf-8"))
    return manifest


def _publish(remote: Remote, root: Path, uploads: list[tuple[str, int]], pointer: str, doc: str) -> None:
    """`uploads` (path, size) from `root`, each checked after upload, then `doc` as `pointer`,
    then the other form's pointer removed: a reader sees the old dataset or the new one."""
    import obstore as obs

    store = remote.store()
    for path, size in uploads:
        with _errors(remote, f"upload {path}"):
            if _size(obs, store, remote.key(path)) == size:
                continue
            with open(root / path, "rb") as f:
                obs.put(store, remote.key(path), f)
            if _size(obs, store, remote.key(path)) != size:
                raise IntegrityError(f"{remote.where(path)}: uploaded, but the store holds another size; push again")
    with _errors(remote, f"upload {pointer}"):
        obs.put(store, remote.key(pointer), doc.encode())
    other = fmt.ARCHIVE_NAME if pointer == fmt.MANIFEST_NAME else fmt.MANIFEST_NAME
    with _errors(remote, f"remove the earlier {other}"):
        if _size(obs, store, remote.key(other)) is not None:
            obs.delete(store, remote.key(other))


def _size(obs, store, key: str) -> int | None:
    try:
        return obs.head(store, key)["size"]
    except Exception as exc:  # noqa: BLE001 - obstore's NotFound has its own class per version
        if _not_found(exc):
            return None
        raise


def _not_found(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError) or "NotFound" in type(exc).__name__ or "not found" in str(exc).lower()


def read_manifest(url: str) -> fmt.Manifest:
    return read_published(url)[0]


def read_published(url: str) -> tuple[fmt.Manifest, dict | None]:
    """The dataset at `url`: its manifest, and for the archive form the compressed file
    (`fmt.ArchiveFile`) of each of its files by path, else None."""
    remote = Remote(url)
    if not fork_safe():
        reply = Helper.get().call({"op": "manifest", "url": url})
        name, text = reply["name"], reply["text"]
    else:
        name, text = _pointer(remote)
    if name == fmt.MANIFEST_NAME:
        return fmt.Manifest.from_json(text, where=remote.where(name)), None
    manifest, files = fmt.archive_from_json(text, where=remote.where(name))
    return manifest, {f.of: f for f in files}


def _pointer(remote: Remote) -> tuple[str, str]:
    """(name, text) of `manifest.json`, else of `archive.json`."""
    import obstore as obs

    from packer.dataset import archive

    store = remote.store()

    def text(name: str) -> str:
        got = obs.get(store, remote.key(name))
        if got.meta["size"] > archive.ARCHIVE_JSON_BYTES:  # not one of ours: not read into memory
            raise IntegrityError(f"{remote.where(name)}: over {archive.ARCHIVE_JSON_BYTES:,} bytes; not an mmpack {name}")
        return bytes(got.bytes()).decode("utf-8")
    with _errors(remote, "read the manifest"):
        try:
            return fmt.MANIFEST_NAME, text(fmt.MANIFEST_NAME)
        except Exception as exc:  # noqa: BLE001 - the archive form's pointer, else this error
            if not _not_found(exc):
                raise
            try:
                return fmt.ARCHIVE_NAME, text(fmt.ARCHIVE_NAME)
            except Exception as other:  # noqa: BLE001
                if _not_found(other):
                    raise exc from None
                raise


def pull(url: str, out: str | Path, *, published: tuple[fmt.Manifest, dict | None] | None = None,
         files: list[fmt.FileEntry] | None = None) -> fmt.Manifest:
    """Download the dataset at `url` (`published`: as `read_published` gave it) into the dir
    `out` (made complete, or left without its manifest): every file (or those of `files`)
    verified by the manifest's checksum, the manifest written last."""
    manifest, packed = published or read_published(url)
    out = Path(out)
    store = functools.cache(Remote(url).store)  # one client, made where it is used (not in a forked child)
    with ThreadPoolExecutor(DOWNLOADS) as pool:  # obstore's GETs release the GIL while they wait
        for done in [pool.submit(fetch_file, store, url, entry, out / entry.path, packed=(packed or {}).get(entry.path))
                     for entry in (_files(manifest) if files is None else files)]:
            done.result()
    for g in sorted({e.path.split("/", 1)[0] for e in _files(manifest) if "/" in e.path}):
        (out / g).mkdir(parents=True, exist_ok=True)
        write_atomic(out / g / fmt.MANIFEST_NAME, manifest.to_json())
        (out / g / fmt.READERS_LOCK).touch()
    write_atomic(out / fmt.MANIFEST_NAME, manifest.to_json())
    return manifest


def fetch_verified(obs, store, remote: Remote, entry: fmt.FileEntry, target: Path, temp=None,
                   packed: fmt.ArchiveFile | None = None) -> None:
    """One file into `target`, verified by the manifest's checksum (kept when it is there and
    whole already); a mismatch is fetched once more, then refused naming the object. `temp`: an
    open part file to write it in (the cache's, reserved at its size), left there verified for
    the caller to rename; else one made here, renamed to `target`. `packed`: the file comes as
    that compressed object (the archive form), decompressed as it arrives."""
    if temp is None and target.is_file() and target.stat().st_size == entry.size_bytes and \
            checksum_file(target, entry.algo) == entry.checksum:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    own = temp is None
    f = open(target.with_name(f".{target.name}.part-{os.getpid()}"), "w+b") if own else temp
    try:
        for _ in (1, 2):
            f.seek(0)
            digest = fmt.hasher(entry.algo)  # hashed as it arrives: no second read of the file
            if digest is None:
                raise IntegrityError(f"{remote.where(entry.path)}: checksum algorithm {entry.algo!r} is not known to "
                                     "this mmpack; use the release that wrote it, or a newer one")
            whole = True
            with _errors(remote, f"download {(packed or entry).path}"):
                if packed is not None:
                    whole = _get_zstd(obs, store, remote, packed, f, digest, entry.size_bytes)
                elif entry.size_bytes > RANGE_BYTES:
                    _get_ranges(obs, store, remote.key(entry.path), f, entry.size_bytes, digest)
                else:
                    for chunk in obs.get(store, remote.key(entry.path)):
                        f.write(chunk)
                        digest.update(chunk)
            f.truncate()
            f.flush()
            if whole and f.tell() == entry.size_bytes and digest.hexdigest() == entry.checksum:
                if own:
                    os.replace(f.name, target)
                return
    finally:
        if own:
            f.close()
            Path(f.name).unlink(missing_ok=True)
    raise IntegrityError(f"{remote.where((packed or entry).path)}: its bytes do not match the checksum "
                         f"{'archive.json and ' if packed else ''}the manifest records (fetched twice); the remote "
                         "dataset is damaged: push it again")


def _get_zstd(obs, store, remote: Remote, packed: fmt.ArchiveFile, f, digest, size: int) -> bool:
    """The compressed object `packed` decompressed into `f` and hashed by `digest` as it
    arrives; whether its compressed bytes are the ones archive.json records. Past `size`
    restored bytes (the manifest's) it stops: a frame that expands without end fills no disk."""
    import zstandard

    from packer.dataset.archive import _Hashing

    wire, got = fmt.new_checksum(), 0
    restored = _Hashing(f, lambda: digest, limit=size, where=remote.where(packed.path))
    try:
        with zstandard.ZstdDecompressor().stream_writer(restored, closefd=False) as sink:
            for chunk in obs.get(store, remote.key(packed.path)):
                wire.update(chunk)
                got += len(chunk)
                sink.write(chunk)
    except (zstandard.ZstdError, IntegrityError):  # damaged on the way or at rest: fetched again, then refused
        return False
    return got == packed.size_bytes and wire.hexdigest() == packed.xxh3_128


def _get_ranges(obs, store, key: str, f, size: int, digest) -> None:
    """The object's bytes written at their offsets in `f`, RANGES ranged GETs at once, then
    hashed in order from the file (the page cache), `f` left at its end. A range that comes
    back short leaves bytes that fail the checksum, as a torn stream does."""
    def one(start: int) -> None:
        data = obs.get_range(store, key, start=start, end=min(start + RANGE_BYTES, size))
        os.pwrite(f.fileno(), memoryview(data), start)
    with ThreadPoolExecutor(RANGES) as pool:
        list(pool.map(one, range(0, size, RANGE_BYTES)))
    for start in range(0, size, RANGE_BYTES):
        digest.update(os.pread(f.fileno(), min(RANGE_BYTES, size - start), start))
    f.seek(size)


def build_dir(url: str) -> Path:
    """Where `packer build RAW URL` builds before it pushes: one local dir per URL."""
    return DEFAULT_CACHE.parent / "builds" / hashlib.sha256(url.encode()).hexdigest()[:16]


def open_cached(url: str, cache_dir: str | Path | None = None, limit: int | None = None):
    """The node's cache entry of the dataset at `url` (`packer.dataset.cache.ShardCache`), made
    with its manifest and index files on first open (the processes of every rank wait for the
    first one); its other files come per shard as readers need them. Pinned to the manifest
    read now: a push after this open is another entry."""
    from packer.dataset.cache import ShardCache, entry_dir

    manifest, packed = read_published(url)
    root = entry_dir(url, manifest, cache_dir)
    cache = ShardCache(url, root, manifest, limit, packed)
    if limit is not None:
        least = cache.index_bytes + max(cache.sizes, default=0)
        if limit < least:
            raise ConfigError(f"{url}: cache_limit {limit:,} bytes is below the {least:,} this dataset needs at "
                              "least (its index files and its largest shard); raise cache_limit")
    if (root / fmt.MANIFEST_NAME).is_file():
        return cache
    root.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "a") as lock:
        flock(lock)
        if not (root / fmt.MANIFEST_NAME).is_file():
            try:
                pull(url, root, published=(manifest, packed), files=cache.index)
            except BaseException:
                if not (root / fmt.MANIFEST_NAME).is_file():
                    shutil.rmtree(root, ignore_errors=True)
                raise
    return cache


def materialize(url: str, cache_dir: str | Path | None = None) -> Path:
    """The whole dataset at `url` in the node's cache (see `open_cached`), and that dir."""
    cache = open_cached(url, cache_dir)
    cache.fetch(range(len(cache.bulk)))
    inputs = cache.manifest.inputs  # the build's record of its inputs: `packer verify` checks it, readers never read it
    if inputs is not None:  # (the archive form has none)
        fetch_file(cache.store, url, inputs, cache.root / inputs.path)
    return cache.root


def fetch_file(store_of, url: str, entry: fmt.FileEntry, target: Path, temp=None,
               packed: fmt.ArchiveFile | None = None) -> None:
    """`fetch_verified` here (`store_of()`: this process's client), or, in a process forked after
    a request, by the helper."""
    if fork_safe():
        import obstore as obs

        fetch_verified(obs, store_of(), Remote(url), entry, target, temp=temp, packed=packed)
    else:
        Helper.get().call({"op": "fetch", "url": url, "entry": entry.to_json(), "target": str(target),
                           "temp": temp.name if temp is not None else None,
                           "packed": dataclasses.asdict(packed) if packed is not None else None})


class Helper:
    """A fresh interpreter (`python -m packer.dataset.remote`) that makes a forked process's
    requests: JSON lines in, JSON lines out, one request at a time; it ends with its parent's
    end of the pipe."""

    _mine: Helper | None = None
    _pid = None

    @classmethod
    def get(cls) -> Helper:
        if cls._mine is None or cls._pid != os.getpid():
            cls._mine, cls._pid = cls(), os.getpid()
        return cls._mine

    def __init__(self):
        import subprocess
        import sys
        import threading

        self._lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-m", "packer.dataset.remote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def call(self, request: dict) -> dict:
        import json

        with self._lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise ConfigError(f"{request.get('url')}: the download helper of this forked process ended")
        reply = json.loads(line)
        if "error" in reply:
            raise (IntegrityError if reply["error"] == "IntegrityError" else ConfigError)(reply["message"])
        return reply


def _serve() -> None:
    """The helper's loop (see `Helper`)."""
    import json
    import sys

    stores: dict = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "manifest":
                name, text = _pointer(Remote(request["url"]))
                reply = {"name": name, "text": text}
            else:
                doc = request["entry"]
                entry = fmt.FileEntry(doc["path"], doc["size_bytes"], doc["checksum"]["hex"], doc["checksum"]["algo"])
                temp = open(request["temp"], "r+b") if request["temp"] else None
                url = request["url"]
                if url not in stores:
                    stores[url] = Remote(url).store()
                try:
                    packed = fmt.ArchiveFile(**request["packed"]) if request.get("packed") else None
                    fetch_file(lambda: stores[url], url, entry, Path(request["target"]), temp, packed)  # noqa: B023
                finally:
                    if temp is not None:
                        temp.close()
                reply = {}
        except (ConfigError, IntegrityError) as exc:
            reply = {"error": type(exc).__name__, "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - sent back as one line
            reply = {"error": "ConfigError", "message": f"{request.get('url')}: {type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
