"""The on-disk contract of an mmpack dataset dir, and nothing else (prose twin: FORMAT.md).

Owns the format name and version, the file-name rule, the manifest schema (frozen dataclasses,
JSON in and out; never pickle), the fixed-length NPY header the writer streams under, and dtype
choices. `packer.writer` and `packer.reader` both go through this module.
"""

from __future__ import annotations

import ast
import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import xxhash

from .errors import ManifestError

# -- 1. Identity and versioning ------------------------------------------------------------
FORMAT_NAME = "mmpack"
FORMAT_VERSION = (3, 0)  # (major, minor): minor bumps are additive, a new major is refused.

# -- 2. Directory layout and the file-name rule ---------------------------------------------
MANIFEST_NAME = "manifest.json"
STAGING_DIR = ".staging"
KINDS = ("images", "pairs", "text")


def shard_dir_name(shard_index: int) -> str:
    """Shard k lives in `shard-{k:05d}/`; the name depends on the shard index only."""
    return f"shard-{shard_index:05d}"


def column_file_names(column: Column) -> dict[str, str]:
    """Files of one column inside a shard dir, by part: values, and for ragged columns offsets
    (and shapes when a sample has more than one dimension)."""
    names = {"values": f"{column.name}.npy"}
    if column.ragged:
        names["offsets"] = f"{column.name}.offsets.npy"
        if len(column.shape) > 1:
            names["shapes"] = f"{column.name}.shapes.npy"
    return names


# -- 3. Column files: NPY v1.0 with a fixed-length header -----------------------------------
NPY_HEADER_BYTES = 128  # magic(6) + version(2) + header_len(2) + dict padded with spaces + "\n"
NPY_MAGIC = b"\x93NUMPY\x01\x00"
OFFSETS_DTYPE = "<i8"
SHAPES_DTYPE = "<i8"


def npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """A standard NPY 1.0 header padded to exactly NPY_HEADER_BYTES, so a writer can stream rows
    behind a placeholder and rewrite the header in place once the row count is known."""
    descr = np.dtype(dtype).str
    text = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (descr, tuple(shape))
    body_len = NPY_HEADER_BYTES - len(NPY_MAGIC) - 2
    if len(text) + 1 > body_len:
        raise ValueError(f"NPY header for shape {shape} does not fit {NPY_HEADER_BYTES} bytes")
    body = text.ljust(body_len - 1).encode("latin1") + b"\n"
    return NPY_MAGIC + body_len.to_bytes(2, "little") + body


def parse_npy_header(raw: bytes) -> tuple[str, tuple[int, ...]]:
    """(dtype str, shape) of a header written by npy_header; ValueError when it is not one."""
    if len(raw) < NPY_HEADER_BYTES or raw[:8] != NPY_MAGIC:
        raise ValueError("not an NPY 1.0 file")
    body_len = int.from_bytes(raw[8:10], "little")
    if body_len != NPY_HEADER_BYTES - 10:
        raise ValueError(f"NPY header is {body_len + 10} bytes, expected {NPY_HEADER_BYTES}")
    try:
        header = ast.literal_eval(raw[10:NPY_HEADER_BYTES].decode("latin1").strip())
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # e.g. a flipped bit: "<i8" -> "<a8"
            return np.dtype(header["descr"]).str, tuple(int(n) for n in header["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError, DeprecationWarning) as exc:
        raise ValueError(f"unreadable NPY header ({exc})") from None


# -- 4. Dtype choices -----------------------------------------------------------------------
def choose_token_dtype(vocab_size: int) -> str:
    """uint16 when every id (0 .. vocab_size-1) fits, else uint32: half the bytes for the usual
    30k-65k vocabularies."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return "<u2" if vocab_size <= 1 << 16 else "<u4"


# -- 5. Manifest schema ---------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    """One column. `shape` is the per-sample shape; None marks a variable dimension, which makes
    the column ragged (flat values plus int64 offsets). `encoding` = "utf-8" marks a string
    column stored as bytes."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]
    encoding: str | None = None

    def __post_init__(self) -> None:
        np.dtype(self.dtype)  # raises TypeError for a bad dtype string
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def ragged(self) -> bool:
        return any(d is None for d in self.shape)

    @property
    def sample_nbytes(self) -> int | None:
        """Bytes of one sample of a fixed-shape column; None for ragged columns."""
        if self.ragged:
            return None
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def columns_text(columns) -> str:
    """'image |u1 [32, 32, 3], key |u1 [None]': columns for a message."""
    return ", ".join(f"{c.name} {c.dtype} {list(c.shape)}" for c in columns)


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the dataset dir, "/"-separated
    size_bytes: int
    xxh3_128_rows: str  # CHECKSUM of the file, hex


@dataclass(frozen=True)
class Shard:
    index: int
    num_samples: int
    files: tuple[FileEntry, ...]

    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)


@dataclass(frozen=True)
class Skip:
    """A record that was found but not packed, with the stage that refused it and why."""

    key: str
    stage: str
    reason: str


@dataclass(frozen=True)
class Manifest:
    kind: str
    columns: tuple[Column, ...]
    shards: tuple[Shard, ...]
    counts: dict[str, int]
    skipped: tuple[Skip, ...] = ()
    classes: tuple[str, ...] | None = None
    tokenizer: dict[str, Any] | None = None
    build: dict[str, Any] = field(default_factory=dict)
    version: str = "%d.%d" % FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ManifestError(f"unknown dataset kind {self.kind!r}; expected one of {KINDS}")
        if self.counts.get("found") != self.counts.get("packed", -1) + self.counts.get("skipped", -1):
            raise ManifestError(f"counts do not add up: {self.counts}")
        if self.counts["packed"] != self.num_samples:
            raise ManifestError(
                f"counts say {self.counts['packed']} packed, shards hold {self.num_samples}"
            )

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def size_bytes(self) -> int:
        return sum(s.size_bytes for s in self.shards)

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_json(self) -> str:
        doc = {"format": FORMAT_NAME, **asdict(self)}
        return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str, *, where: str = "manifest") -> Manifest:
        """Parse and validate; ManifestError naming `where` for anything off."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where}: not an {FORMAT_NAME} manifest (no 'format': 'mmpack')")
        check_version(str(doc.get("version", "")), where=where)
        try:
            return cls(
                kind=doc["kind"],
                columns=tuple(Column(**c) for c in doc["columns"]),
                shards=tuple(
                    Shard(s["index"], s["num_samples"], tuple(FileEntry(**f) for f in s["files"]))
                    for s in doc["shards"]
                ),
                counts=dict(doc["counts"]),
                skipped=tuple(Skip(**s) for s in doc.get("skipped", ())),
                classes=tuple(doc["classes"]) if doc.get("classes") is not None else None,
                tokenizer=doc.get("tokenizer"),
                build=dict(doc.get("build", {})),
                version=doc["version"],
            )
        except ManifestError as exc:
            raise ManifestError(f"{where}: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from None


# -- 6. Integrity: the checksum of every column file (manifest) and compressed file (archive) -
# A column file's checksum is XXH3-128 over the XXH3-128 digests of its blocks: its header, then
# its rows in blocks of whole rows (one row per block from 32 KiB rows up). Each block can be
# hashed by whoever writes it, in any order, while it is still in the CPU's cache: the processes
# decoding one shard's images hash the rows they write, and no one reads the shard back.
CHECKSUM = "xxh3_128_rows"  # lowercase hex: finds torn writes and flipped bits, not forgers
BLOCK_BYTES = 64 * 1024  # rows per block: as many as fit, at least one


def rows_per_block(row_bytes: int) -> int:
    return max(1, BLOCK_BYTES // max(1, row_bytes))


def block_digest(data) -> bytes:
    """XXH3-128 of one block (any buffer), its 16 bytes in canonical (big-endian) order."""
    return xxhash.xxh3_128_digest(data)


def checksum_of_blocks(digests) -> str:
    """The checksum of a file from its blocks' digests, in file order (the header's first)."""
    h = xxhash.xxh3_128()
    for digest in digests:
        h.update(digest)
    return h.hexdigest()


def data_block_bytes(header: bytes) -> int:
    """Bytes per data block of a column file that starts with `header`: whole rows of its shape;
    BLOCK_BYTES when it is not a header of ours (a damaged file must hash, to a mismatch)."""
    try:
        dtype, shape = parse_npy_header(header)
    except ValueError:
        return BLOCK_BYTES
    row = np.dtype(dtype).itemsize * math.prod(shape[1:])
    return rows_per_block(row) * row if row else BLOCK_BYTES


class FileChecksum:
    """CHECKSUM of a column file fed its bytes in order, in pieces of any size (update /
    hexdigest, like hashlib). A file shorter than a header is one block of what it holds."""

    def __init__(self):
        self._head, self._block, self._left = bytearray(), 0, 0
        self._blocks, self._current = xxhash.xxh3_128(), xxhash.xxh3_128()

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        if not self._block:
            need = NPY_HEADER_BYTES - len(self._head)
            self._head += view[:need]
            view = view[need:]
            if len(self._head) < NPY_HEADER_BYTES:
                return
            self._blocks.update(block_digest(self._head))
            self._block = self._left = data_block_bytes(bytes(self._head))
        while len(view):
            take = min(self._left, len(view))
            self._current.update(view[:take])
            view, self._left = view[take:], self._left - take
            if not self._left:
                self._blocks.update(self._current.digest())
                self._current.reset()
                self._left = self._block

    def hexdigest(self) -> str:
        blocks = self._blocks.copy()
        if not self._block:
            blocks.update(block_digest(self._head))
        elif self._left != self._block:  # the last block, shorter
            blocks.update(self._current.digest())
        return blocks.hexdigest()


def new_checksum():
    """A hasher (update / hexdigest) of a compressed archive file: plain XXH3-128 of its bytes."""
    return xxhash.xxh3_128()


# -- 9. Archive form --------------------------------------------------------------------------
ARCHIVE_NAME = "archive.json"
ARCHIVE_FORMAT = "mmpack-archive"
ARCHIVE_SUFFIX = ".zst"


@dataclass(frozen=True)
class ArchiveFile:
    path: str  # the compressed file, relative to the archive dir: "<of>.zst"
    of: str  # the column file it restores, relative to the dataset dir
    size_bytes: int  # compressed
    xxh3_128: str  # XXH3-128 of the compressed bytes (new_checksum; the raw file's is the manifest's)


def archive_to_json(manifest: Manifest, files: list[ArchiveFile], level: int) -> str:
    doc = {"format": ARCHIVE_FORMAT, "version": "%d.%d" % FORMAT_VERSION, "codec": "zstd", "level": level,
           "files": [asdict(f) for f in files], "manifest": json.loads(manifest.to_json())}
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def archive_from_json(text: str, *, where: str) -> tuple[Manifest, list[ArchiveFile]]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != ARCHIVE_FORMAT or doc.get("codec") != "zstd":
        raise ManifestError(f"{where}: not an {ARCHIVE_FORMAT} (zstd) description")
    check_version(str(doc.get("version", "")), where=where)
    manifest = Manifest.from_json(json.dumps(doc.get("manifest")), where=where)
    try:
        files = [ArchiveFile(**f) for f in doc["files"]]
    except (KeyError, TypeError) as exc:
        raise ManifestError(f"{where}: malformed file list ({exc})") from None
    listed = {f.path for s in manifest.shards for f in s.files}
    if {f.of for f in files} != listed:
        raise ManifestError(f"{where}: the file list does not match the manifest's files")
    return manifest, files


def check_version(version: str, *, where: str) -> None:
    """Readers accept any minor of their own major; another major is refused, naming both."""
    try:
        major, _minor = (int(p) for p in version.split("."))
    except ValueError:
        raise ManifestError(f"{where}: unreadable format version {version!r}") from None
    if major != FORMAT_VERSION[0]:
        raise ManifestError(
            f"{where}: format version {version} is not supported by this reader "
            f"(reads {FORMAT_VERSION[0]}.x); use an mmpack release that reads {major}.x"
        )
