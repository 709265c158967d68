"""FORMAT.md sections 2 and 7: the format's name and version (and which versions this reader
opens), the directory layout and the file-name rule."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from packer.errors import ManifestError

if TYPE_CHECKING:
    from packer.dataset.format.manifest import Column

# -- 1. Identity and versioning ------------------------------------------------------------
FORMAT_NAME = "mmpack"
FORMAT_VERSION = (4, 3)  # (major, minor): minor bumps are additive, a newer major is refused.
# What a writer writes: the oldest version that has what the dataset uses, so a dataset of a kind
# 4.0 knew is the same bytes as before, and opens in a 4.0 reader; 4.1 added audio, 4.2 the JPEG
# lane (a column of encoding "jpeg"), 4.3 conversations (tokens with their loss mask) and the
# columns a user writes (packer.Writer, packer.map), with bfloat16 among them
KIND_VERSIONS = {"audio": (4, 1), "chat": (4, 3), "columns": (4, 3)}
ENCODING_VERSIONS = {"jpeg": (4, 2), "bfloat16": (4, 3), "pixels-list": (4, 3), "jpeg-list": (4, 3)}
BASE_VERSION = (4, 0)


def written_version(kind: str, columns: tuple[Column, ...] = ()) -> str:
    """The version a writer writes for a dataset of `kind` with `columns`."""
    return "%d.%d" % max([KIND_VERSIONS.get(kind, BASE_VERSION), *(ENCODING_VERSIONS.get(c.encoding, BASE_VERSION)
                                                                   for c in columns)])


READABLE_MAJORS = (1, 2, 3, 4)  # 1.x-3.x differ from 4.x in checksum keys and the shard dirs' place
CHECKSUM = "xxh3_128_rows"  # what this writer hashes column files with (section 6)

# -- 2. Directory layout and the file-name rule ---------------------------------------------
MANIFEST_NAME = "manifest.json"
STAGING_DIR = ".staging"
INPUTS_NAME = "inputs.jsonl"  # in a generation dir: one [key, size_bytes, mtime_ns] line per RAW file
LOCK_NAME = ".mmpack.lock"  # in OUT: held (flock) by the one process writing OUT
READERS_LOCK = ".readers.lock"  # in a generation dir: shared-locked by every reader of it
KINDS = ("images", "pairs", "text", "audio", "chat", "columns")
_GENERATION = re.compile(r"g-[0-9a-f]{8,64}")
NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def is_column_name(name: str) -> bool:
    """A column's name: [A-Za-z_][A-Za-z0-9_]*, at most 64 characters (its files are named by it)."""
    return isinstance(name, str) and NAME_PATTERN.fullmatch(name) is not None


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
