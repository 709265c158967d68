"""Opens and validates a dataset dir as read-only maps (pairs with `packer.dataset.writer`).

Opening reads the manifest (validated: `format.Manifest.from_json`) and stats each file:
O(shards), never O(samples). Column files are mapped lazily, once per process, read-only and
shared (`np.memmap(mode="r")`): pages come from the page cache every process shares, a write
through a map raises instead of changing what later reads see, and a map costs nothing against
the kernel's commit limit (a private copy-on-write map of a 25 GB shard does, and fails under
strict overcommit). The loaders copy out of the maps (`ds[i]`, every batch gather). A ragged
column's offsets are checked (from 0, non-decreasing, ending at its values' length) before they
index anything.

A reader holds a shared lock on each generation dir its manifest uses, so a rebuild of the
same OUT (which writes a new generation) removes the old one only once no reader has it open;
the reader pickles as (root, generation) and re-opens that very generation in each worker.
Every failure on a damaged or hostile dataset is an MmpackError naming the file.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import os
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import numpy as np

from packer.dataset import codec
from packer.dataset import format as fmt
from packer.errors import ColumnError, IntegrityError, ManifestError
from packer.system import flock

OPEN_ATTEMPTS = 5  # manifest reads while a writer swaps it, before giving up


def manifest_path(root: Path, generation: str | None = None) -> Path:
    """The dataset's manifest, or the copy its generation dir keeps (what a worker re-opens)."""
    return root / generation / fmt.MANIFEST_NAME if generation else root / fmt.MANIFEST_NAME


def read_manifest_text(root: str | Path, generation: str | None = None) -> str:
    root = Path(root)
    path = manifest_path(root, generation)
    if not root.is_dir():
        raise ManifestError(f"{root}: no such dataset dir")
    if not path.is_file():
        if generation:
            raise IntegrityError(f"{root}: generation {generation}, which this reader was opened on, is gone "
                                 "(the dataset was rebuilt); open the dataset again")
        if (root / fmt.STAGING_DIR).exists():
            raise ManifestError(
                f"{root}: incomplete build (no {fmt.MANIFEST_NAME}, a {fmt.STAGING_DIR} dir is "
                "present); run the build again"
            )
        raise ManifestError(f"{root}: not an mmpack dataset (no {fmt.MANIFEST_NAME})")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: unreadable ({exc})") from None


def load_manifest(root: str | Path, generation: str | None = None) -> fmt.Manifest:
    path = manifest_path(Path(root), generation)
    return fmt.Manifest.from_json(read_manifest_text(root, generation), where=str(path))


def check_file_sizes(root: Path, shards: Iterable[fmt.Shard], skip: frozenset[str] = frozenset()) -> None:
    """Every file of these shards (but those in `skip`) exists with the size the manifest
    records (one stat per file)."""
    for shard in shards:
        for entry in shard.files:
            if entry.path in skip:
                continue
            path = root / entry.path
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise IntegrityError(
                    f"{path}: missing; the dataset is damaged, run 'packer verify {root}'"
                ) from None
            if size != entry.size_bytes:
                raise IntegrityError(
                    f"{path}: {size:,} bytes, manifest says {entry.size_bytes:,}; "
                    f"the dataset is damaged, run 'packer verify {root}'"
                )


def check_shards_listed(root: Path, manifest: fmt.Manifest) -> None:
    """Every shard dir inside the generation dirs the manifest uses is one it lists (one listing
    per generation): a manifest that drops a shard, its counts fixed up, is not the build."""
    listed = {s.dir for s in manifest.shards}
    for generation in sorted(manifest.generations):
        try:
            names = os.listdir(root / generation)
        except OSError:
            continue  # a missing generation: the size check names its files
        extra = sorted(f"{generation}/{n}" for n in names if n.startswith("shard-") and f"{generation}/{n}" not in listed)
        if extra:
            raise IntegrityError(f"{root / extra[0]}: a shard dir the manifest does not list ({len(extra)} such); "
                                 f"the manifest is not the one its build wrote, run 'packer verify {root}'")


@dataclass(frozen=True)
class ColumnArrays:
    """The mapped arrays of one column of one shard. Fixed columns: `values` is [rows, *shape].
    Ragged: flat `values`, `offsets` [rows + 1], optional `shapes` [rows, ndim]; `jpeg`: the
    values file of a JPEG column (`packer.dataset.codec`), whose samples are decoded."""

    values: np.ndarray
    offsets: np.ndarray | None = None
    shapes: np.ndarray | None = None
    jpeg: str | None = None

    def sample(self, row: int, out: np.ndarray | None = None) -> np.ndarray:
        """Sample `row`: a view of the map, or a JPEG's pixels (into `out`'s corner if given)."""
        if self.offsets is None:
            return self.values[row]
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        flat = self.values[start:end]
        if self.jpeg is not None:
            return codec.decode(flat, self.shapes[row], f"{self.jpeg}: row {row}", out)
        return flat if self.shapes is None else flat.reshape(tuple(self.shapes[row]))


def map_npy(path: Path, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Map one column file and check its header against what the manifest implies."""
    try:
        with open(path, "rb") as f:
            head = f.read(fmt.NPY_HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise IntegrityError(f"{path}: cannot be read ({exc.strerror or exc}); run 'packer verify'") from None
    try:
        got_dtype, got_shape = fmt.parse_npy_header(head)
    except ValueError as exc:
        raise IntegrityError(f"{path}: {exc}") from None
    if got_dtype != np.dtype(dtype).str or got_shape != tuple(shape):
        raise IntegrityError(
            f"{path}: header says {got_dtype} {got_shape}, manifest implies "
            f"{np.dtype(dtype).str} {tuple(shape)}"
        )
    nbytes = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
    if size != fmt.NPY_HEADER_BYTES + nbytes:
        raise IntegrityError(f"{path}: {size:,} bytes, its shape {tuple(shape)} needs "
                             f"{fmt.NPY_HEADER_BYTES + nbytes:,}; run 'packer verify'")
    if nbytes == 0:
        return np.zeros(shape, dtype=dtype)
    mapped = np.memmap(path, dtype=dtype, mode="r", offset=fmt.NPY_HEADER_BYTES, shape=tuple(shape))
    # a plain ndarray view of the map (which it keeps open): indexing an np.memmap runs Python
    # (__array_finalize__, __getitem__) per access: a gather of 256 images ran at 59k/s on np.memmap
    # objects, 74k/s on these views
    return mapped.view(np.ndarray)


def map_column(shard_dir: Path, column: fmt.Column, num_samples: int, values_dir: Path | None = None) -> ColumnArrays:
    """One column of one shard, every part checked against the others before use. `values_dir`:
    where its values file is, if not beside the others (a remote batch's rows, read by range)."""
    names = fmt.column_file_names(column)
    values_path = (values_dir or shard_dir) / names["values"]
    if not column.ragged:
        return ColumnArrays(map_npy(values_path, column.dtype, (num_samples, *column.shape)))
    offsets_path = shard_dir / names["offsets"]
    offsets = map_npy(offsets_path, fmt.OFFSETS_DTYPE, (num_samples + 1,))
    try:
        values_bytes = values_path.stat().st_size - fmt.NPY_HEADER_BYTES
    except OSError as exc:
        raise IntegrityError(f"{values_path}: cannot be read ({exc.strerror or exc}); run 'packer verify'") from None
    check_offsets(offsets_path, offsets, values_bytes // np.dtype(column.dtype).itemsize)
    values = map_npy(values_path, column.dtype, (int(offsets[-1]),))
    shapes = None
    if "shapes" in names:
        shapes_path = shard_dir / names["shapes"]
        shapes = map_npy(shapes_path, fmt.SHAPES_DTYPE, (num_samples, len(column.shape)))
        check_shapes(shapes_path, shapes, offsets, column)
    return ColumnArrays(values, offsets, shapes, str(values_path) if column.encoded else None)


def map_index(shard_dir: Path, column: fmt.Column, num_samples: int, values_bytes: int) -> ColumnArrays:
    """A ragged column's offsets and shapes without its values (`values` empty), checked as
    `map_column` checks them: what a reader of a dataset whose values are not all there (a
    remote one's cache) sizes batches and groups shapes by."""
    names = fmt.column_file_names(column)
    offsets = map_npy(shard_dir / names["offsets"], fmt.OFFSETS_DTYPE, (num_samples + 1,))
    check_offsets(shard_dir / names["offsets"], offsets, (values_bytes - fmt.NPY_HEADER_BYTES) // np.dtype(column.dtype).itemsize)
    shapes = None
    if "shapes" in names:
        shapes = map_npy(shard_dir / names["shapes"], fmt.SHAPES_DTYPE, (num_samples, len(column.shape)))
        check_shapes(shard_dir / names["shapes"], shapes, offsets, column)
    return ColumnArrays(np.zeros(0, column.dtype), offsets, shapes)


def check_offsets(path: Path, offsets: np.ndarray, num_values: int) -> None:
    """Offsets start at 0, never decrease and end at the number of values the file holds."""
    if offsets[0] != 0:
        raise IntegrityError(f"{path}: first offset is {offsets[0]}, expected 0; run 'packer verify'")
    steps = np.diff(offsets)
    if steps.size and steps.min() < 0:
        raise IntegrityError(f"{path}: offsets decrease at row {int(np.argmin(steps))}; run 'packer verify'")
    if offsets[-1] != num_values:
        raise IntegrityError(f"{path}: offsets end at {offsets[-1]}, the values file holds {num_values}; "
                             "run 'packer verify'")


def check_shapes(path: Path, shapes: np.ndarray, offsets: np.ndarray, column: fmt.Column) -> None:
    """Each sample's shape is non-negative, fits the column's fixed dimensions and holds exactly
    its values, in exact arithmetic (`exact_sizes`): dimensions whose product wraps past 2**63
    onto the right count must not pass (a JPEG column's: by each decode)."""
    wrong = ((shapes < 0) | (shapes >= fmt.MAX_DIM)).any(axis=1)
    for axis, d in ((axis, d) for axis, d in enumerate(column.shape) if d is not None):
        wrong |= shapes[:, axis] != d
    if wrong.any():
        r = int(np.argmax(wrong))
        raise IntegrityError(f"{path}: row {r}'s shape {tuple(int(d) for d in shapes[r])} is negative or does not fit "
                             f"{list(column.shape)}; run 'packer verify'")
    if column.encoded:
        return
    sizes = np.diff(offsets)
    bad = np.flatnonzero(exact_sizes(shapes, int(offsets[-1]) if len(offsets) else 0) != sizes)
    if bad.size:
        raise IntegrityError(f"{path}: row {bad[0]} holds {sizes[bad[0]]} values, "
                             f"shape {tuple(int(d) for d in shapes[bad[0]])}")


def exact_sizes(shapes: np.ndarray, limit: int) -> np.ndarray:
    """The product of each row of non-negative `shapes` (int64 [rows, ndim]), or -1 where it
    passes `limit` (a shape with a zero dimension is 0 whatever the others): axis by axis,
    multiplying only where the product stays within `limit`, so nothing wraps."""
    prod = np.ones(len(shapes), np.int64)
    over = np.zeros(len(shapes), bool)
    for axis in range(shapes.shape[1] if shapes.ndim == 2 else 0):
        d = shapes[:, axis]
        over |= (d > 0) & (prod > limit // np.maximum(d, 1))
        prod = np.where(over, 0, prod * np.where(over, 0, d))
    zero = (shapes == 0).any(axis=1) if shapes.size else np.zeros(len(shapes), bool)
    return np.where(zero, 0, np.where(over, -1, prod))


class _GenerationLocks:
    """Shared flocks on the READERS_LOCK of each generation a manifest uses: while they are held,
    a writer of the same OUT leaves those generations in place."""

    def __init__(self, root: Path, generations: Iterable[str]):
        self.files = []
        # closed when the reader is collected or the interpreter exits: a dataset open for a whole
        # run would otherwise end it with "ResourceWarning: unclosed file" (an error under -W error)
        weakref.finalize(self, _close_all, self.files)
        for generation in sorted(generations):
            try:
                f = open(root / generation / fmt.READERS_LOCK, "rb")
            except FileNotFoundError:
                if (root / generation).is_dir():  # a copy without its hidden files: read unlocked
                    continue
                self.close()  # a writer removed the generation since the manifest was read
                raise
            except OSError:  # unreadable here (permissions): read unlocked
                continue
            self.files.append(f)
            flock(f, shared=True)

    def close(self) -> None:
        _close_all(self.files)


def _close_all(files: list) -> None:
    for f in files:
        f.close()
    files.clear()


class DatasetReader:
    """A dataset dir: manifest, sample-id -> (shard, row) index, and lazily mapped columns.

    `generation`: open that generation's own manifest (a worker re-opening what its parent
    opened) rather than the dataset's current one. `cache`: the dir is a remote dataset's cache
    entry (`packer.remote.cache.ShardCache`), whose shards are fetched and pinned as they are
    mapped, and unpinned by `release`."""

    def __init__(self, root: str | Path, generation: str | None = None, cache=None):
        self.root, self.cache = Path(root), cache
        self.manifest, self._locks = self._open(generation)
        self.generation = self.manifest.generation
        skip = frozenset(e.path for files in cache.bulk for e in files) if cache is not None else frozenset()
        check_file_sizes(self.root, self.manifest.shards, skip)
        check_shards_listed(self.root, self.manifest)
        self._ends = list(accumulate(s.num_samples for s in self.manifest.shards))
        self._maps: dict[tuple[int, str], ColumnArrays] = {}

    def _open(self, generation: str | None) -> tuple[fmt.Manifest, _GenerationLocks]:
        """The manifest, with its generations locked; read again if a writer replaced it meanwhile."""
        where = str(manifest_path(self.root, generation))
        for _ in range(OPEN_ATTEMPTS):
            text = read_manifest_text(self.root, generation)
            manifest = fmt.Manifest.from_json(text, where=where)
            try:
                locks = _GenerationLocks(self.root, manifest.generations)
            except FileNotFoundError:  # a writer removed it since the manifest was read
                if generation:
                    read_manifest_text(self.root, generation)  # says it is gone
                continue
            if generation or read_manifest_text(self.root) == text:
                return manifest, locks
            locks.close()
        raise IntegrityError(f"{self.root}: the dataset keeps changing while it is opened (is a build writing "
                             "it?); open it once the build is done")

    def close(self) -> None:
        self._locks.close()

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @functools.cached_property
    def content_id(self) -> str:
        """The identity of the dataset's samples: its kind, columns and every file's checksum
        (two builds of the same bytes share it; build timings do not count)."""
        return content_id(self.manifest)

    @property
    def shard_ends(self) -> list[int]:
        """Cumulative sample counts: shard k holds sample ids [ends[k-1], ends[k])."""
        return self._ends

    def locate(self, sample_id: int) -> tuple[int, int]:
        """Global sample id -> (shard position, row); Python sequence rules for negatives."""
        n = len(self)
        index = sample_id + n if sample_id < 0 else sample_id
        if not 0 <= index < n:
            raise IndexError(f"sample {sample_id} out of range for a dataset of {n} samples")
        k = bisect.bisect_right(self._ends, index)
        return k, index - (self._ends[k - 1] if k else 0)

    def check_columns(self, names) -> None:
        """ColumnError naming what is missing and what there is, for columns a caller asks for."""
        have = [c.name for c in self.manifest.columns]
        unknown = sorted(set(names) - set(have))
        if unknown:
            raise ColumnError(f"{self.root}: no column(s) {', '.join(unknown)}; columns are {', '.join(have)}")

    def column(self, shard_pos: int, name: str) -> ColumnArrays:
        key = (shard_pos, name)
        if self.cache is not None:  # pinned in this process (a forked child maps its parent's maps)
            self.cache.acquire(shard_pos)
        arrays = self._maps.get(key)
        if arrays is None:
            shard = self.manifest.shards[shard_pos]
            arrays = map_column(self.root / shard.dir, self.manifest.column(name), shard.num_samples)
            self._maps[key] = arrays
        return arrays

    def index(self, shard_pos: int, name: str) -> ColumnArrays:
        """A ragged column's offsets and shapes, without fetching a remote dataset's values."""
        if self.cache is None:
            return self.column(shard_pos, name)
        key = (shard_pos, f"{name}\0index")
        arrays = self._maps.get(key)
        if arrays is None:
            shard, column = self.manifest.shards[shard_pos], self.manifest.column(name)
            values = fmt.column_file_names(column)["values"]
            size = next(f.size_bytes for f in shard.files if f.path.rsplit("/", 1)[-1] == values)
            arrays = self._maps[key] = map_index(self.root / shard.dir, column, shard.num_samples, size)
        return arrays

    def values_path(self, shard_pos: int, name: str) -> str:
        """The path of a column's values file in shard `shard_pos`, from the dataset dir."""
        return f"{self.manifest.shards[shard_pos].dir}/{fmt.column_file_names(self.manifest.column(name))['values']}"

    def spans(self, shard_pos: int, name: str, rows: np.ndarray) -> tuple[str, np.ndarray]:
        """The path of a column's values file in shard `shard_pos`, and the byte spans [start,
        end) of `rows` in it ([len(rows), 2]): what a remote reader fetches to read them."""
        column = self.manifest.column(name)
        path = self.values_path(shard_pos, name)
        rows = np.asarray(rows, np.int64)
        if column.ragged:
            offsets, item = self.index(shard_pos, name).offsets, np.dtype(column.dtype).itemsize
            starts, ends = offsets[rows] * item, offsets[rows + 1] * item
        else:
            row = np.dtype(column.dtype).itemsize * int(np.prod(column.shape, dtype=np.int64))
            starts = rows * row
            ends = starts + row
        return path, np.stack([starts, ends], axis=1).astype(np.int64) + fmt.NPY_HEADER_BYTES

    def column_in(self, shard_pos: int, name: str, values_dir: Path | None) -> ColumnArrays:
        """A column of a shard whose files the caller made present and pinned, its values file
        under `values_dir` if given (shard dirs below it, as in the dataset dir), mapped now and
        not kept: the caller holds it while it may."""
        shard = self.manifest.shards[shard_pos]
        return map_column(self.root / shard.dir, self.manifest.column(name), shard.num_samples,
                          values_dir / shard.dir if values_dir is not None else None)

    def release(self, shard_pos: int, soften: bool = False) -> None:
        """Unmaps a remote dataset's shard and unpins it (the cache may then evict it), or with
        `soften` leaves it softly pinned (this process may evict it for a shard needed sooner)."""
        for key in [key for key in self._maps if key[0] == shard_pos and not key[1].endswith("\0index")]:
            del self._maps[key]
        if self.cache is not None:
            (self.cache.soften if soften else self.cache.release)(shard_pos)

    def key_bytes(self) -> Iterator[bytes]:
        """Every sample's key as its UTF-8 bytes, in sample order (one shard's keys in memory at
        a time)."""
        for pos in range(len(self.manifest.shards)):
            keys = self.column(pos, "key")
            raw, offsets = keys.values.tobytes(), keys.offsets.tolist()
            yield from (raw[a:b] for a, b in zip(offsets, offsets[1:]))

    def class_counts(self) -> np.ndarray | None:
        """Samples of each class (int64 [len(classes)]); None without classes. Reads the label
        column: 8 bytes a sample."""
        classes, parts = self.manifest.classes, self._label_parts()
        if classes is None or parts is None:
            return None
        counts = np.zeros(len(classes), np.int64)
        for labels in parts:  # a shard at a time: memory independent of the dataset's size
            inside = labels[(labels >= 0) & (labels < len(classes))]  # packer verify names the others
            counts += np.bincount(inside, minlength=len(classes))
        return counts

    def labels(self) -> np.ndarray | None:
        """Every sample's label in sample order (int64 [num_samples]); None without a label
        column. 8 bytes a sample, read from the label column of each shard."""
        parts = self._label_parts()
        return None if parts is None else np.concatenate([np.zeros(0, np.int64), *parts])

    def _label_parts(self):
        """Each shard's label column (int64), in sample order, as an iterator; None without one."""
        if not any(c.name == "label" for c in self.manifest.columns):
            return None
        return (np.asarray(self.column(k, "label").values, np.int64) for k in range(len(self.manifest.shards)))

    def sample(self, sample_id: int, name: str) -> np.ndarray:
        shard_pos, row = self.locate(sample_id)
        return self.column(shard_pos, name).sample(row)

    def __getstate__(self) -> dict:
        return {"root": str(self.root), "generation": self.generation, "cache": self.cache}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["root"], state.get("generation"), state.get("cache"))


def content_id(manifest: fmt.Manifest) -> str:
    doc = [manifest.kind, [[c.name, c.dtype, list(c.shape), c.encoding] for c in manifest.columns],
           [[s.num_samples, [[f.path.rsplit("/", 1)[-1], f.size_bytes, f.algo, f.checksum] for f in s.files]]
            for s in manifest.shards]]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]
