"""FORMAT.md section 5: the manifest schema, as frozen dataclasses with JSON in and out (never
pickle); every field of a manifest from a stranger checked before anything is mapped."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from packer.dataset.format.layout import (CHECKSUM, FORMAT_NAME, INPUTS_NAME, KINDS, NAME_PATTERN, check_version,
                                          column_file_names, is_generation, shard_dir_name, shard_path, written_version)
from packer.dataset.format.npy import NPY_HEADER_BYTES
from packer.errors import ColumnError, ManifestError

# -- 5. Manifest schema ---------------------------------------------------------------------
# A manifest may come from a stranger: every field is checked before anything is mapped or
# allocated, and every problem is a ManifestError naming the field (never a Python exception).
DTYPES = frozenset({"|u1", "|i1", "|b1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8"})
# "jpeg" (4.2): an image column stored as JPEG bytes (section 4); "bfloat16" (4.3): a column of
# bfloat16 numbers' bits (<i2); "pixels-list" and "jpeg-list" (4.3): a sample's images of their
# own sizes one after another, as pixels or JPEG files, each's shape and bytes in IMAGE_LIST_INDEX
ENCODINGS = (None, "utf-8", "jpeg", "bfloat16", "pixels-list", "jpeg-list")
IMAGE_LISTS = ("pixels-list", "jpeg-list")
IMAGE_LIST_INDEX = {"image_shapes": ("<i8", (None, 3)), "image_nbytes": ("<i8", (None,))}  # beside an image list
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
        if not isinstance(self.name, str) or not NAME_PATTERN.fullmatch(self.name):
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
        if self.string and (self.dtype != "|u1" or tuple(shape) != (None,)):
            raise ManifestError(f"column {self.name}: a string column is |u1 [null]")
        if self.encoded and (self.dtype != "|u1" or len(shape) != 3 or shape[2] != 3 or (shape[0] is None) != (
                shape[1] is None)):
            raise ManifestError(f"column {self.name}: a jpeg column is |u1 [S, S, 3] or [null, null, 3]")
        if self.image_list and (self.dtype != "|u1" or tuple(shape) != (None,)):
            raise ManifestError(f"column {self.name}: a {self.encoding} column is |u1 [null] (its images' bytes)")
        if self.encoding == "bfloat16" and self.dtype != "<i2":
            raise ManifestError(f"column {self.name}: a bfloat16 column is stored as <i2 (its numbers' bits)")
        object.__setattr__(self, "shape", tuple(shape))

    @property
    def bfloat16(self) -> bool:
        """bfloat16 numbers, stored as their 16 bits (<i2); read as bfloat16."""
        return self.encoding == "bfloat16"

    @property
    def image_list(self) -> bool:
        """A sample's images of their own sizes, their bytes one after another (pixels or JPEG
        files): each's shape and byte count in the `image_shapes` and `image_nbytes` columns."""
        return self.encoding in IMAGE_LISTS

    @property
    def string(self) -> bool:
        """Text stored as its bytes (a key)."""
        return self.encoding == "utf-8"

    @property
    def encoded(self) -> bool:
        """Images stored as JPEG bytes, read as the pixels of `shape` they decode to: stored as
        a ragged column (bytes, offsets, each sample's decoded shape) whatever `shape` says."""
        return self.encoding == "jpeg"

    @property
    def ragged(self) -> bool:
        return self.encoded or any(d is None for d in self.shape)

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
    """'image |u1 [32, 32, 3], key |u1 [None]': columns for a message (a JPEG column's: 'as JPEG')."""
    return ", ".join(f"{c.name} {c.dtype} {list(c.shape)}{' as JPEG' if c.encoded else ''}"
                     f"{f' ({c.encoding})' if c.image_list else ''}" for c in columns)


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
    audio: dict[str, Any] | None = None  # an audio dataset's {"sample_rate", "channels", "dtype"} (4.1)
    version: str | None = None  # None: the version this writer writes for the kind (`written_version`)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ManifestError(f"unknown dataset kind {self.kind!r}; expected one of {KINDS}")
        if self.version is None:
            object.__setattr__(self, "version", written_version(self.kind, self.columns))
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
        check_audio(self.kind, self.audio, self.columns)
        check_image_lists(self.columns)
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
        if self.audio is None:  # a key of 4.1: the other kinds' manifests are what 4.0 wrote
            del doc["audio"]
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
                columns=tuple(Column(**fields(c, ("name", "dtype", "shape"), ("encoding",))) for c in as_list(doc["columns"])),
                shards=tuple(Shard(s["index"], s["num_samples"], tuple(_file_entry(f, major) for f in as_list(s["files"])))
                             for s in map(_dict, as_list(doc["shards"]))),
                counts=_dict(doc["counts"]),
                skipped=tuple(Skip(**fields(k, ("key", "stage", "reason"), (), str)) for k in as_list(doc.get("skipped", []))),
                classes=_strings(doc.get("classes"), "classes"),
                tokenizer=_dict(doc["tokenizer"]) if doc.get("tokenizer") is not None else None,
                build=_dict(doc.get("build", {})),
                generation=_generation(doc.get("generation"), major),
                inputs=_file_entry(doc["inputs"], major) if doc.get("inputs") is not None else None,
                audio=_dict(doc["audio"]) if doc.get("audio") is not None else None,
                version=doc["version"],
            )
        except ManifestError as exc:
            raise ManifestError(f"{where}: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from None


AUDIO_DTYPES = ("<i2", "<f4")  # int16 PCM, or float32 as decoded
MAX_CHANNELS = 8
MAX_SAMPLE_RATE = 768_000


def audio_column(dtype: str, channels: int) -> Column:
    """The `audio` column of an audio dataset: [T] mono, [T, C] with more channels."""
    return Column("audio", dtype, (None,) if channels == 1 else (None, channels))


def check_audio(kind: str, audio, columns: tuple[Column, ...]) -> None:
    """An audio dataset's `audio` object (FORMAT.md section 5): its rate, channels and dtype,
    and an `audio` column that matches them; no other kind has one, but a `columns` dataset
    with an `audio` column (4.3)."""
    if kind != "audio" and not (kind == "columns" and audio is not None):
        if audio is not None:
            raise ManifestError(f"a {kind} dataset has no audio object")
        return
    if not isinstance(audio, dict):
        raise ManifestError("an audio dataset needs its audio object {sample_rate, channels, dtype}")
    rate, channels, dtype = audio.get("sample_rate"), audio.get("channels"), audio.get("dtype")
    if type(rate) is not int or not 1 <= rate <= MAX_SAMPLE_RATE:
        raise ManifestError(f"audio sample_rate {rate!r} is not an int in 1..{MAX_SAMPLE_RATE}")
    if type(channels) is not int or not 1 <= channels <= MAX_CHANNELS:
        raise ManifestError(f"audio channels {channels!r} is not an int in 1..{MAX_CHANNELS}")
    if dtype not in AUDIO_DTYPES:
        raise ManifestError(f"audio dtype {dtype!r} is not one of {', '.join(AUDIO_DTYPES)}")
    want = audio_column(dtype, channels)
    if want not in columns:
        raise ManifestError(f"an audio dataset of {channels} channel(s) {dtype} needs column audio {dtype} "
                            f"{list(want.shape)}; it has {columns_text(columns)}")


def check_image_lists(columns: tuple[Column, ...]) -> None:
    """An image-list column (one at most) comes with the columns that index it, as FORMAT.md
    section 4 lays them out ("Conversations")."""
    lists = [c for c in columns if c.image_list]
    if len(lists) > 1:
        raise ManifestError(f"columns {', '.join(c.name for c in lists)}: a dataset has one image-list column at most")
    if lists:
        have = {c.name: (c.dtype, c.shape) for c in columns}
        for name, (dtype, shape) in IMAGE_LIST_INDEX.items():
            if have.get(name) != (dtype, shape):
                raise ManifestError(f"column {lists[0].name} ({lists[0].encoding}) needs column {name} {dtype} "
                                    f"{[None if d is None else d for d in shape]}; it has {columns_text(columns)}")


LEGACY_CHECKSUMS = {1: "sha256", 2: "xxh3_128", 3: "xxh3_128_rows"}  # the key each major used, by algorithm
HEX_DIGITS = {"sha256": 64, "xxh3_128": 32, "xxh3_128_rows": 32}


def as_list(value) -> list:
    if not isinstance(value, list):
        raise ManifestError(f"expected a list, got {type(value).__name__}")
    return value


def _dict(value) -> dict:
    if not isinstance(value, dict):
        raise ManifestError(f"expected an object, got {type(value).__name__}")
    return value


def fields(doc, required: tuple[str, ...], optional: tuple[str, ...], kind: type | None = None) -> dict:
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


def printable(name: str) -> str:
    """A name as the manifest can hold it: as is when it is valid UTF-8; else its bytes that are
    not, written as \\xNN escapes (file names are bytes on Linux; a key is UTF-8)."""
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        return os.fsencode(name).decode("utf-8", "backslashreplace")
