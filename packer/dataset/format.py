"""The on-disk contract of an mmpack dataset dir, and nothing else (prose twin: FORMAT.md).

Owns the format name and version, the file-name rule, the manifest schema (frozen dataclasses,
JSON in and out; never pickle), the fixed-length NPY header the writer streams under, and dtype
choices. `packer.dataset.writer` and `packer.dataset.reader` both go through this module.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
import threading
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import xxhash

from packer.errors import ColumnError, ManifestError

# -- 1. Identity and versioning ------------------------------------------------------------
FORMAT_NAME = "mmpack"
FORMAT_VERSION = (4, 0)  # (major, minor): minor bumps are additive, a newer major is refused.
READABLE_MAJORS = (1, 2, 3, 4)  # 1.x-3.x differ from 4.x in checksum keys and the shard dirs' place
CHECKSUM = "xxh3_128_rows"  # what this writer hashes column files with (section 6)

# -- 2. Directory layout and the file-name rule ---------------------------------------------
MANIFEST_NAME = "manifest.json"
STAGING_DIR = ".staging"
INPUTS_NAME = "inputs.jsonl"  # in a generation dir: one [key, size_bytes, mtime_ns] line per RAW file
LOCK_NAME = ".mmpack.lock"  # in OUT: held (flock) by the one process writing OUT
READERS_LOCK = ".readers.lock"  # in a generation dir: shared-locked by every reader of it
KINDS = ("images", "pairs", "text")
_GENERATION = re.compile(r"g-[0-9a-f]{8,64}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def generation_name(fingerprint: str) -> str:
    """The generation dir of a build: named by the build's fingerprint, so a build killed and
    run again writes into the same one."""
    return f"g-{fingerprint[:16]}"


def is_generation(name: str) -> bool:
    return _GENERATION.fullmatch(name) is not None


def shard_dir_name(shard_index: int) -> str:
    """Shard k lives in `shard-{k:05d}/`; the name depends on the shard index only."""
    return f"shard-{shard_index:05d}"


def shard_path(generation: str | None, shard_index: int) -> str:
    """A shard dir relative to the dataset dir: `<generation>/shard-k` (4.x), `shard-k` before."""
    name = shard_dir_name(shard_index)
    return f"{generation}/{name}" if generation else name


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


# ast.literal_eval and warnings.catch_warnings change interpreter-wide state: threads reading
# headers at once (unpack, verify, the remote cache's restores) take turns. On CPython 3.11 a
# collection during one thread's parse let another's corrupt the AST depth count: "SystemError:
# AST constructor recursion depth mismatch" (CPython gh-106905).
_HEADER_LOCK = threading.Lock()


def parse_npy_header(raw: bytes) -> tuple[str, tuple[int, ...]]:
    """(dtype str, shape) of a header written by npy_header; ValueError when it is not one."""
    if len(raw) < NPY_HEADER_BYTES or raw[:8] != NPY_MAGIC:
        raise ValueError("not an NPY 1.0 file")
    body_len = int.from_bytes(raw[8:10], "little")
    if body_len != NPY_HEADER_BYTES - 10:
        raise ValueError(f"NPY header is {body_len + 10} bytes, expected {NPY_HEADER_BYTES}")
    try:
        with _HEADER_LOCK:
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
# A manifest may come from a stranger: every field is checked before anything is mapped or
# allocated, and every problem is a ManifestError naming the field (never a Python exception).
DTYPES = frozenset({"|u1", "|i1", "|b1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8"})
ENCODINGS = (None, "utf-8")
MAX_DIM = 1 << 31  # per-sample dimensions
MAX_NDIM = 8


@dataclass(frozen=True)
class Column:
    """One column. `shape` is the per-sample shape; None marks a variable dimension, which makes
    the column ragged (flat values plus int64 offsets). `encoding` = "utf-8" marks a string
    column stored as bytes. The constructor refuses what FORMAT.md section 5 does not allow."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]
    encoding: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ManifestError(f"column name {self.name!r} is not a plain name ([A-Za-z_][A-Za-z0-9_]*)")
        if self.dtype not in DTYPES:
            raise ManifestError(f"column {self.name}: dtype {self.dtype!r} is not one of {', '.join(sorted(DTYPES))}")
        shape = self.shape
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM or not all(
                d is None or (type(d) is int and 0 <= d < MAX_DIM) for d in shape):
            raise ManifestError(f"column {self.name}: shape {shape!r} is not a list of at most {MAX_NDIM} "
                                "dimensions (non-negative ints, or null for a variable one)")
        if self.encoding not in ENCODINGS:
            raise ManifestError(f"column {self.name}: encoding {self.encoding!r} is not one of {ENCODINGS}")
        if self.encoding and (self.dtype != "|u1" or tuple(shape) != (None,)):
            raise ManifestError(f"column {self.name}: a string column is |u1 [null]")
        object.__setattr__(self, "shape", tuple(shape))

    @property
    def ragged(self) -> bool:
        return any(d is None for d in self.shape)

    @property
    def sample_nbytes(self) -> int | None:
        """Bytes of one sample of a fixed-shape column; None for ragged columns."""
        if self.ragged:
            return None
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def file_bytes(self, part: str, num_samples: int) -> int | None:
        """The exact size of one of its files in a shard of `num_samples` rows (None: a ragged
        column's values, whose length only its offsets know)."""
        if part == "offsets":
            return NPY_HEADER_BYTES + (num_samples + 1) * 8
        if part == "shapes":
            return NPY_HEADER_BYTES + num_samples * len(self.shape) * 8
        return None if self.ragged else NPY_HEADER_BYTES + num_samples * self.sample_nbytes


def columns_text(columns) -> str:
    """'image |u1 [32, 32, 3], key |u1 [None]': columns for a message."""
    return ", ".join(f"{c.name} {c.dtype} {list(c.shape)}" for c in columns)


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the dataset dir, "/"-separated
    size_bytes: int
    checksum: str  # hex digest of the file by `algo`
    algo: str = CHECKSUM

    def to_json(self) -> dict:
        return {"path": self.path, "size_bytes": self.size_bytes, "checksum": {"algo": self.algo, "hex": self.checksum}}


@dataclass(frozen=True)
class Shard:
    index: int
    num_samples: int
    files: tuple[FileEntry, ...]

    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    @property
    def dir(self) -> str:
        """The shard dir, relative to the dataset dir (where its files are)."""
        return self.files[0].path.rsplit("/", 1)[0] if self.files else shard_dir_name(self.index)


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
    generation: str | None = None  # the generation dir this build's shards went into (4.x)
    inputs: FileEntry | None = None  # INPUTS_NAME in the generation: every RAW file's size and mtime
    version: str = "%d.%d" % FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ManifestError(f"unknown dataset kind {self.kind!r}; expected one of {KINDS}")
        if not self.columns or len({c.name for c in self.columns}) != len(self.columns):
            raise ManifestError("columns must be a non-empty list of distinct names")
        counts = self.counts
        if not isinstance(counts, dict) or not all(type(counts.get(k)) is int and counts[k] >= 0
                                                   for k in ("found", "packed", "skipped")):
            raise ManifestError(f"counts must hold found, packed and skipped as non-negative ints: {counts!r}")
        if counts["found"] != counts["packed"] + counts["skipped"]:
            raise ManifestError(f"counts do not add up: {counts}")
        if counts["packed"] != self.num_samples:
            raise ManifestError(f"counts say {counts['packed']} packed, shards hold {self.num_samples}")
        if counts["skipped"] != len(self.skipped):
            raise ManifestError(f"counts say {counts['skipped']} skipped, the skip list has {len(self.skipped)}")
        if self.generation is not None and not is_generation(self.generation):
            raise ManifestError(f"generation {self.generation!r} is not a generation dir name (g-<hex>)")
        if self.inputs is not None and (self.generation is None or self.inputs.path != f"{self.generation}/{INPUTS_NAME}"
                                        or type(self.inputs.size_bytes) is not int or self.inputs.size_bytes < 0):
            raise ManifestError(f"inputs {self.inputs.path!r} is not {self.generation}/{INPUTS_NAME}")
        for shard in self.shards:
            self._check_shard(shard)
        for a, b in zip(self.shards, self.shards[1:]):
            if b.index <= a.index:
                raise ManifestError(f"shard {b.index} comes after shard {a.index}: shard indexes must increase "
                                    "through the list (a shard listed twice, or out of order)")

    def _check_shard(self, shard: Shard) -> None:
        """Its files are exactly its columns' files, in one shard dir, with the sizes the row
        count implies: nothing outside the dataset dir, nothing to allocate that is not there."""
        where = f"shard {shard.index}"
        if type(shard.index) is not int or not 0 <= shard.index < 10**9:
            raise ManifestError(f"{where}: index must be an int in [0, 1e9)")
        if type(shard.num_samples) is not int or not 0 < shard.num_samples < 1 << 48:
            raise ManifestError(f"{where}: num_samples must be a positive int, got {shard.num_samples!r}")
        prefix = shard.dir.rsplit("/", 1)[0] if "/" in shard.dir else None
        if prefix is not None and not is_generation(prefix):
            raise ManifestError(f"{where}: file {shard.files[0].path!r} is not under a generation dir (g-<hex>)")
        base = shard_path(prefix, shard.index)
        want = {f"{base}/{name}": (column, part) for column in self.columns
                for part, name in column_file_names(column).items()}
        if sorted(f.path for f in shard.files) != sorted(want):
            raise ManifestError(f"{where}: files {sorted(f.path for f in shard.files)[:4]} are not its columns' "
                                f"files {sorted(want)[:4]}")
        for f in shard.files:
            column, part = want[f.path]
            size = column.file_bytes(part, shard.num_samples)
            itemsize = np.dtype(column.dtype).itemsize
            if type(f.size_bytes) is not int or (size is not None and f.size_bytes != size) or (
                    size is None and (f.size_bytes < NPY_HEADER_BYTES or (f.size_bytes - NPY_HEADER_BYTES) % itemsize)):
                raise ManifestError(f"{f.path}: size_bytes {f.size_bytes!r} does not fit {shard.num_samples} rows of "
                                    f"column {column.name} ({column.dtype} {list(column.shape)})")

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def size_bytes(self) -> int:
        return sum(s.size_bytes for s in self.shards)

    @property
    def generations(self) -> set[str]:
        """Every generation dir the dataset uses: its own, and those of its shards' files."""
        own = {self.generation} if self.generation else set()
        return own | {s.dir.split("/", 1)[0] for s in self.shards if "/" in s.dir}

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise ColumnError(f"no column {name!r}; this {self.kind} dataset has {', '.join(c.name for c in self.columns)}")

    def to_json(self) -> str:
        doc = {"format": FORMAT_NAME, **asdict(self)}
        doc["shards"] = [{"index": s.index, "num_samples": s.num_samples, "files": [f.to_json() for f in s.files]}
                         for s in self.shards]
        doc["inputs"] = self.inputs.to_json() if self.inputs else None
        return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str, *, where: str = "manifest") -> Manifest:
        """Parse and validate a manifest of any readable version; ManifestError naming `where`
        and the field for anything off."""
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ManifestError(f"{where}: not valid JSON ({exc})") from None
        return cls.from_doc(doc, where=where)

    @classmethod
    def from_doc(cls, doc, *, where: str) -> Manifest:
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where}: not an {FORMAT_NAME} manifest (no 'format': 'mmpack')")
        major = check_version(doc.get("version"), where=where)
        try:
            return cls(
                kind=doc["kind"],
                columns=tuple(Column(**_fields(c, ("name", "dtype", "shape"), ("encoding",))) for c in _list(doc["columns"])),
                shards=tuple(Shard(s["index"], s["num_samples"], tuple(_file_entry(f, major) for f in _list(s["files"])))
                             for s in map(_dict, _list(doc["shards"]))),
                counts=_dict(doc["counts"]),
                skipped=tuple(Skip(**_fields(k, ("key", "stage", "reason"), (), str)) for k in _list(doc.get("skipped", []))),
                classes=_strings(doc.get("classes"), "classes"),
                tokenizer=_dict(doc["tokenizer"]) if doc.get("tokenizer") is not None else None,
                build=_dict(doc.get("build", {})),
                generation=_generation(doc.get("generation"), major),
                inputs=_file_entry(doc["inputs"], major) if doc.get("inputs") is not None else None,
                version=doc["version"],
            )
        except ManifestError as exc:
            raise ManifestError(f"{where}: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from None


LEGACY_CHECKSUMS = {1: "sha256", 2: "xxh3_128", 3: "xxh3_128_rows"}  # the key each major used, by algorithm
HEX_DIGITS = {"sha256": 64, "xxh3_128": 32, "xxh3_128_rows": 32}


def _list(value) -> list:
    if not isinstance(value, list):
        raise ManifestError(f"expected a list, got {type(value).__name__}")
    return value


def _dict(value) -> dict:
    if not isinstance(value, dict):
        raise ManifestError(f"expected an object, got {type(value).__name__}")
    return value


def _fields(doc, required: tuple[str, ...], optional: tuple[str, ...], kind: type | None = None) -> dict:
    doc = _dict(doc)
    missing = [k for k in required if k not in doc]
    if missing:
        raise ManifestError(f"missing {', '.join(missing)} in {sorted(doc)[:6]}")
    out = {k: doc[k] for k in (*required, *optional) if k in doc}
    if kind is not None and not all(isinstance(v, kind) for v in out.values()):
        raise ManifestError(f"{sorted(out)} must be {kind.__name__}s")
    return out


def _strings(value, name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ManifestError(f"{name} must be a list of strings")
    return tuple(value)


def _generation(value, major: int) -> str | None:
    if value is not None and major < 4:
        raise ManifestError(f"a {major}.x manifest has no generation")
    return value


def _file_entry(doc, major: int) -> FileEntry:
    """A file entry of any readable major: 4.x {"checksum": {"algo", "hex"}}, before that the
    hex under the algorithm's own key."""
    doc = _dict(doc)
    path = doc.get("path")
    if not isinstance(path, str) or not path or "\0" in path or "\\" in path or path.startswith("/") or any(
            part in ("", ".", "..") for part in path.split("/")):
        raise ManifestError(f"file path {path!r} is not a plain relative path inside the dataset dir")
    if major >= 4:
        checksum = _dict(doc.get("checksum"))
        algo, digest = checksum.get("algo"), checksum.get("hex")
    else:
        algo = LEGACY_CHECKSUMS[major]
        digest = doc.get(algo)
    if not isinstance(algo, str) or not re.fullmatch(r"[a-z0-9_]{1,32}", algo):
        raise ManifestError(f"{path}: checksum algorithm {algo!r} is not a name")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{%d}" % HEX_DIGITS.get(algo, 128), digest) and (
            algo in HEX_DIGITS or not re.fullmatch(r"[0-9a-f]{1,128}", digest)):
        raise ManifestError(f"{path}: checksum {digest!r} is not a {algo} hex digest")
    return FileEntry(path, doc.get("size_bytes"), digest, algo)


# -- 6. Integrity: the checksum of every column file (manifest) and compressed file (archive) -
# A column file's checksum is XXH3-128 over the XXH3-128 digests of its blocks: its header, then
# its rows in blocks of whole rows (one row per block from 32 KiB rows up). Each block can be
# hashed by whoever writes it, in any order, while it is still in the CPU's cache: the processes
# decoding one shard's images hash the rows they write, and no one reads the shard back.
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


def hasher(algo: str):
    """A new hasher (update / hexdigest) of a column file by `algo`, the algorithms of every
    readable version; None for one this reader does not know (a newer minor's)."""
    if algo == CHECKSUM:
        return FileChecksum()
    if algo == "xxh3_128":  # 2.x
        return xxhash.xxh3_128()
    if algo == "sha256":  # 1.x
        return hashlib.sha256()
    return None


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
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != ARCHIVE_FORMAT or doc.get("codec") != "zstd":
        raise ManifestError(f"{where}: not an {ARCHIVE_FORMAT} (zstd) description")
    if check_version(doc.get("version"), where=where) < 3:
        raise ManifestError(f"{where}: archives of format {doc.get('version')} are not read by this mmpack; "
                            "unpack it with the release that packed it")
    manifest = Manifest.from_doc(doc.get("manifest"), where=where)
    try:
        files = [ArchiveFile(**_fields(f, ("path", "of", "size_bytes", "xxh3_128"), ())) for f in _list(doc["files"])]
    except (KeyError, TypeError, ManifestError) as exc:
        raise ManifestError(f"{where}: malformed file list ({exc})") from None
    listed = {f.path for s in manifest.shards for f in s.files}
    if sorted(f.of for f in files) != sorted(listed) or any(
            f.path != f.of + ARCHIVE_SUFFIX or type(f.size_bytes) is not int or not isinstance(f.xxh3_128, str)
            for f in files):
        raise ManifestError(f"{where}: the file list does not match the manifest's files")
    return manifest, files


def check_version(version, *, where: str) -> int:
    """The major of a readable version: every major up to this reader's; a newer one is refused,
    naming both."""
    try:
        major, minor = (int(p) for p in str(version).split("."))
    except ValueError:
        raise ManifestError(f"{where}: unreadable format version {version!r}") from None
    if major not in READABLE_MAJORS or minor < 0:
        raise ManifestError(
            f"{where}: format version {version} is not supported by this reader "
            f"(reads {READABLE_MAJORS[0]}.x to {FORMAT_VERSION[0]}.x); use an mmpack release that reads {major}.x"
        )
    return major
