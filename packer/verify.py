"""`packer verify`: re-hash every file and check headers, offsets and row counts.

`DatasetReader` checks sizes on open (cheap); this is the full check. It stops at the first
problem and raises IntegrityError naming the file and what is wrong.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import format as fmt
from .errors import IntegrityError
from .reader import check_file_sizes, load_manifest, map_column
from .writer import checksum_file


def verify(root: str | Path, *, on_progress=None) -> dict:
    """Returns {"files", "size_bytes", "num_samples"} when all is well."""
    root = Path(root)
    manifest = load_manifest(root)
    check_file_sizes(root, manifest.shards)  # missing or resized files, before any hashing
    files = size_bytes = 0
    total = sum(len(s.files) for s in manifest.shards)
    for shard in manifest.shards:
        for entry in shard.files:
            _check_hash(root, entry)
            files += 1
            size_bytes += entry.size_bytes
            if on_progress:
                on_progress(files, total)
        shard_dir = root / fmt.shard_dir_name(shard.index)
        for column in manifest.columns:
            arrays = map_column(shard_dir, column, shard.num_samples)
            if arrays.offsets is not None:
                _check_offsets(shard_dir / fmt.column_file_names(column)["offsets"], arrays)
    return {"files": files, "size_bytes": size_bytes, "num_samples": manifest.num_samples}


def _check_hash(root: Path, entry: fmt.FileEntry) -> None:
    path = root / entry.path
    digest = checksum_file(path)
    if digest != entry.xxh3_128_rows:
        raise IntegrityError(f"{path}: checksum {digest[:16]}..., manifest says {entry.xxh3_128_rows[:16]}... "
                             f"({fmt.CHECKSUM})")


def _check_offsets(path: Path, arrays) -> None:
    offsets = np.asarray(arrays.offsets)
    if offsets[0] != 0:
        raise IntegrityError(f"{path}: first offset is {offsets[0]}, expected 0")
    steps = np.diff(offsets)
    if steps.size and steps.min() < 0:
        row = int(np.argmin(steps))
        raise IntegrityError(f"{path}: offsets decrease at row {row}")
    if arrays.shapes is not None:
        shapes = np.asarray(arrays.shapes)
        if shapes.size and shapes.min() < 0:
            raise IntegrityError(f"{path}: negative sample shape")
        bad = np.flatnonzero(np.prod(shapes, axis=1) != steps)
        if bad.size:
            raise IntegrityError(f"{path}: row {bad[0]} holds {steps[bad[0]]} values, shape {tuple(shapes[bad[0]])}")
