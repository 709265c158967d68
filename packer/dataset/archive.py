"""zstd archives of a dataset dir, for storage and transfer (FORMAT.md, "Archive form").

`pack` compresses every column file (zstd, files in parallel threads, `level`) into ARCHIVE/
beside `archive.json`, which holds the dataset's manifest (raw sizes and checksums) plus each
compressed file's size and checksum. `unpack` restores a dataset dir into a new generation and
publishes it as a build does (`packer.dataset.outdir`), checking both checksums of every file; a damaged byte is an
IntegrityError naming the file. `materialize` does that once into a cache dir, under a file
lock, so many processes opening the same archive at once unpack it exactly once.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from packer.dataset import format as fmt
from packer.dataset import outdir, writer
from packer.errors import ConfigError, IntegrityError
from packer.dataset.reader import DatasetReader
from packer.system import available_cores, flock

_CHUNK = 1 << 20
FILE_LIKE = (".zst", ".tar", ".tgz", ".gz", ".zip", ".xz", ".bz2")  # names users give archive files


@dataclass(frozen=True)
class Transfer:
    raw_bytes: int
    packed_bytes: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.raw_bytes / max(self.packed_bytes, 1)

    @property
    def mb_per_s(self) -> float:
        """Raw (uncompressed) megabytes per second, the figure both directions share."""
        return self.raw_bytes / 1e6 / max(self.seconds, 1e-9)


class Hashing:
    """A file wrapper that hashes every byte read or written through it: a column file with the
    format's checksum (fmt.FileChecksum), a compressed one with fmt.new_checksum. With `limit`,
    going past that many bytes is an IntegrityError naming `where`: a compressed file that
    expands past the size the manifest records is stopped there, not written until the disk is
    full. `f` None: the bytes written are hashed and dropped (verify)."""

    def __init__(self, f, hasher, *, limit: int | None = None, where: str = ""):
        self.f, self.digest, self.count = f, hasher(), 0  # hasher: a callable making a hash object
        self.limit, self.where = limit, where

    def _counted(self, data) -> None:
        self.count += len(data)
        if self.limit is not None and self.count > self.limit:
            raise IntegrityError(f"{self.where}: holds more than the {self.limit:,} bytes {fmt.ARCHIVE_NAME} "
                                 "records; the archive is damaged")
        self.digest.update(data)

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n if n >= 0 or self.limit is None else self.limit + 1)
        self._counted(data)
        return data

    def write(self, data) -> int:
        self._counted(data)
        return len(data) if self.f is None else self.f.write(data)


def open_regular(path: Path):
    """A binary file object of `path`, which must be a regular file: a FIFO (opened without
    blocking, never read), a device or a folder is an IntegrityError, not a hang."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise IntegrityError(f"{path}: missing from the archive") from None
    except OSError as exc:
        raise IntegrityError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IntegrityError(f"{path}: not a regular file; the archive is damaged")
    return os.fdopen(fd, "rb")


def is_archive(path: str | Path) -> bool:
    return (Path(path) / fmt.ARCHIVE_NAME).is_file()


def _threads(threads: int | None) -> int:
    return threads or available_cores()


def pack(root: str | Path, archive: str | Path, *, level: int = 3, threads: int | None = None,
         overwrite: bool = False) -> Transfer:
    """Compress the dataset dir `root` into the archive dir `archive`."""
    import zstandard

    root, archive = Path(root), Path(archive)
    if archive.name.endswith(FILE_LIKE) and not archive.is_dir():
        raise ConfigError(f"{archive}: an archive is a directory (its column files zstd-compressed beside "
                          f"{fmt.ARCHIVE_NAME}); give it a directory's name, e.g. {archive.name.split('.')[0]}.archive")
    opened = DatasetReader(root)  # open until the copy is done: its generation stays
    manifest = dataclasses.replace(opened.manifest, inputs=None)  # RAW's file table stays with RAW's dataset
    if not 1 <= level <= 22:
        raise ConfigError(f"zstd level {level} is outside zstd's 1..22")
    with outdir.locked(archive):
        _fresh_archive(archive, overwrite)
        staging = archive / fmt.STAGING_DIR
        entries = [f for s in manifest.shards for f in s.files]
        started = time.perf_counter()

        def one(entry: fmt.FileEntry) -> fmt.ArchiveFile:
            src, dst = root / entry.path, staging / (entry.path + fmt.ARCHIVE_SUFFIX)
            dst.parent.mkdir(parents=True, exist_ok=True)
            digest = fmt.hasher(entry.algo)
            with open(src, "rb") as fin, writer.naming(dst), open(dst, "wb") as fout:
                reader, out = Hashing(fin, lambda: digest or fmt.new_checksum()), Hashing(fout, fmt.new_checksum)
                zstandard.ZstdCompressor(level=level, write_checksum=True).copy_stream(reader, out, read_size=_CHUNK)
                fout.flush()
                os.fsync(fout.fileno())
            if digest is not None and reader.digest.hexdigest() != entry.checksum:
                raise IntegrityError(f"{src}: checksum differs from the manifest; run 'packer verify {root}'")
            return fmt.ArchiveFile(entry.path + fmt.ARCHIVE_SUFFIX, entry.path, out.count, out.digest.hexdigest())

        with ThreadPoolExecutor(_threads(threads)) as pool:
            files = list(pool.map(one, entries))
        doc = fmt.archive_to_json(manifest, files, level)
        for f in files:
            (archive / f.path).parent.mkdir(parents=True, exist_ok=True)
            os.rename(staging / f.path, archive / f.path)
        outdir.write_atomic(archive / fmt.ARCHIVE_NAME, doc)
        shutil.rmtree(staging, ignore_errors=True)
    return Transfer(manifest.size_bytes, sum(f.size_bytes for f in files), time.perf_counter() - started)


def _fresh_archive(path: Path, overwrite: bool) -> None:
    """An empty archive dir to write into: refused when it holds anything unless `overwrite`,
    and even then only when it is an archive (it holds archive.json)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path}: exists and is not a directory")
    names = {p.name for p in path.iterdir()} - {fmt.STAGING_DIR, fmt.LOCK_NAME}
    if names:
        if not overwrite:
            raise ConfigError(f"{path}: already exists and is not empty; pass --overwrite to replace it")
        if fmt.ARCHIVE_NAME not in names:
            raise ConfigError(f"{path}: not made by mmpack (no {fmt.ARCHIVE_NAME}); refusing to overwrite it")
        (path / fmt.ARCHIVE_NAME).unlink()  # first: from here on it is no longer an archive
        outdir.fsync_dir(path)
    for child in path.iterdir():
        if child.name != fmt.LOCK_NAME:
            shutil.rmtree(child) if child.is_dir() else child.unlink()


def unpack(archive: str | Path, out: str | Path, *, threads: int | None = None, overwrite: bool = False) -> Transfer:
    """Restore the dataset dir `out` from `archive`, checking both checksums of every file."""
    archive, out = Path(archive), Path(out)
    packed, files = read_archive(archive)
    with outdir.locked(out):
        outdir.check_out(out, append=False, overwrite=overwrite)
        check_room(out, packed.size_bytes)
        shutil.rmtree(outdir.staging_dir(out), ignore_errors=True)
        generation = outdir.new_generation()
        outdir.prepare_generation(out, generation)
        manifest = _in_generation(packed, generation)
        where = {f.path: g.path for s, t in zip(packed.shards, manifest.shards) for f, g in zip(s.files, t.files)}
        raw = {f.path: f for s in packed.shards for f in s.files}
        started = time.perf_counter()

        def one(entry: fmt.ArchiveFile) -> None:
            dst = out / where[entry.of]
            dst.parent.mkdir(parents=True, exist_ok=True)
            with writer.naming(dst), open(dst, "wb") as fout:
                _restore(archive, entry, raw[entry.of], fout)
                fout.flush()
                os.fsync(fout.fileno())

        try:
            with ThreadPoolExecutor(_threads(threads)) as pool:
                list(pool.map(one, files))
        except BaseException:
            shutil.rmtree(out / generation, ignore_errors=True)
            raise
        outdir.publish(out, manifest)
    return Transfer(manifest.size_bytes, sum(f.size_bytes for f in files), time.perf_counter() - started)


def _restore(archive: Path, entry: fmt.ArchiveFile, want: fmt.FileEntry, sink) -> None:
    """Decompress one archive file into `sink` (a file, or None to hash and drop), checking the
    compressed bytes against archive.json and the restored ones against the manifest, and
    reading and writing no more than each records."""
    import zstandard

    src = archive / entry.path
    digest = fmt.hasher(want.algo)
    with open_regular(src) as fin:
        reader = Hashing(fin, fmt.new_checksum, limit=entry.size_bytes, where=str(src))
        result = Hashing(sink, lambda: digest or fmt.new_checksum(), limit=want.size_bytes, where=str(src))
        try:
            zstandard.ZstdDecompressor().copy_stream(reader, result, read_size=_CHUNK)
        except zstandard.ZstdError as exc:
            raise IntegrityError(f"{src}: damaged archive file (zstd: {exc})") from None
    if reader.count != entry.size_bytes or reader.digest.hexdigest() != entry.xxh3_128:
        raise IntegrityError(f"{src}: damaged archive file (size or checksum differs from {fmt.ARCHIVE_NAME})")
    if result.count != want.size_bytes or (digest is not None and result.digest.hexdigest() != want.checksum):
        raise IntegrityError(f"{src}: unpacks to data whose checksum differs from the manifest")


def check_room(out: Path, nbytes: int) -> None:
    """ENOSPC naming `out` before anything is written when its disk has less than `nbytes` free."""
    free = shutil.disk_usage(out).free
    if free < nbytes:
        raise OSError(errno.ENOSPC, f"the dataset needs {nbytes / 2**20:,.1f} MiB, the disk has "
                                    f"{free / 2**20:,.1f} MiB free", str(out))


def verify_archive(archive: str | Path, *, threads: int | None = None, on_progress=None) -> dict:
    """Decompress every file of an archive without writing it, checking both checksums (what
    `packer verify` does to a dataset dir); {"files", "size_bytes", "num_samples"} when all is well."""
    archive = Path(archive)
    packed, files = read_archive(archive)
    raw = {f.path: f for s in packed.shards for f in s.files}
    done = []

    def one(entry: fmt.ArchiveFile) -> None:
        _restore(archive, entry, raw[entry.of], None)
        done.append(entry)
        if on_progress:
            on_progress(len(done), len(files))

    with ThreadPoolExecutor(_threads(threads)) as pool:
        list(pool.map(one, files))
    return {"files": len(files), "size_bytes": packed.size_bytes, "num_samples": packed.num_samples}


def _in_generation(manifest: fmt.Manifest, generation: str) -> fmt.Manifest:
    """The manifest with every shard moved into `generation` (what an unpacked copy is)."""
    shards = tuple(fmt.Shard(s.index, s.num_samples, tuple(
        fmt.FileEntry(f"{fmt.shard_path(generation, s.index)}/{f.path.rsplit('/', 1)[-1]}", f.size_bytes, f.checksum,
                      f.algo) for f in s.files)) for s in manifest.shards)
    return dataclasses.replace(manifest, shards=shards, generation=generation, inputs=None,
                               version=fmt.written_version(manifest.kind, manifest.columns))


ARCHIVE_JSON_BYTES = 1 << 30  # archive.json past this is not one of ours: not read into memory


def read_archive(archive: Path) -> tuple[fmt.Manifest, list[fmt.ArchiveFile]]:
    return parse(archive, description(archive))


def description(archive: Path) -> bytes:
    """The bytes of archive.json: a regular file of at most ARCHIVE_JSON_BYTES."""
    path = archive / fmt.ARCHIVE_NAME
    if not path.is_file():
        raise ConfigError(f"{archive}: not an mmpack archive (no {fmt.ARCHIVE_NAME})")
    with open_regular(path) as f:
        raw = f.read(ARCHIVE_JSON_BYTES + 1)
    if len(raw) > ARCHIVE_JSON_BYTES:
        raise IntegrityError(f"{path}: over {ARCHIVE_JSON_BYTES >> 20} MiB; not an mmpack archive description")
    return raw


def parse(archive: Path, raw: bytes) -> tuple[fmt.Manifest, list[fmt.ArchiveFile]]:
    path = archive / fmt.ARCHIVE_NAME
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise IntegrityError(f"{path}: not UTF-8 at byte {exc.start}; the archive is damaged") from None
    return fmt.archive_from_json(text, where=str(path))


def default_cache_dir() -> Path:
    return Path(os.environ.get("MMPACK_CACHE", Path.home() / ".cache" / "mmpack" / "archives"))


def materialize(archive: str | Path, cache_dir: str | Path | None = None) -> tuple[Path, bool]:
    """The dataset dir of `archive` inside `cache_dir`, unpacked on first use; (dir, unpacked now?).

    Safe when many processes call it at once: one unpacks under an exclusive lock, the others
    wait and then open the published result. The cache entry is named by the archive's digest,
    so a changed archive never reuses an old entry."""
    archive = Path(archive)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    raw = description(archive)
    parse(archive, raw)  # valid before anything is made in the cache
    ident = hashlib.sha256(raw).hexdigest()[:20]
    target = cache / ident
    if (target / fmt.MANIFEST_NAME).is_file():
        return target, False
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with open(cache / f"{ident}.lock", "w") as lock:
            flock(lock)
            if (target / fmt.MANIFEST_NAME).is_file():
                return target, False
            if target.exists():  # a killed unpack: staging only, never a manifest
                shutil.rmtree(target)
            unpack(archive, target)
            return target, True
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        where = "$MMPACK_CACHE" if cache_dir is None else "cache_dir"
        raise ConfigError(f"{cache}: no room to unpack {archive} ({exc.strerror}); point {where} at a disk "
                          "with room, or free space there") from None
