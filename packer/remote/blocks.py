"""Block lists (FORMAT.md 9, object storage form): which column files a reader over a URL
reads by rows, the blocks of a file and the bytes each holds, and a list checked against the
manifest (its XXH3-128 is the file's checksum). What `packer push` writes and
`packer.remote.rows` reads."""

from __future__ import annotations

import math

import numpy as np

from packer.dataset import format as fmt
from packer.dataset.format.checksum import BLOCK_BYTES, rows_per_block

BLOCKS = ".blocks"  # a block list's suffix in the store; in the cache, the dir of a shard's lists
DIGEST = 16  # bytes of a block's digest in a list
RAGGED_ROW_BLOCKS = 4  # a ragged column is read by rows where its mean row spans this many blocks


def values_files(manifest: fmt.Manifest):
    """(shard, column, file entry) of each column's values file in each shard."""
    for shard in manifest.shards:
        for c in manifest.columns:
            name = fmt.column_file_names(c)["values"]
            entry = next((e for e in shard.files if e.path.rsplit("/", 1)[-1] == name), None)
            if entry is not None:
                yield shard, c, entry


def header_of(shard: fmt.Shard, column: fmt.Column, entry: fmt.FileEntry) -> bytes | None:
    """The header the manifest implies for a values file (its dtype and shape); None where none
    fits the header's bytes."""
    item = np.dtype(column.dtype).itemsize
    shape = ((entry.size_bytes - fmt.NPY_HEADER_BYTES) // item,) if column.ragged else \
        (shard.num_samples, *column.shape)
    try:
        return fmt.npy_header(np.dtype(column.dtype).str, shape)
    except (TypeError, ValueError):
        return None


def ranged(manifest: fmt.Manifest) -> dict[str, int]:
    """The column files read by rows, by path: their data block's bytes (FORMAT.md 6). Files of
    rows of a block or more each (fixed rows of over 32 KiB; ragged values whose mean row spans
    RAGGED_ROW_BLOCKS blocks), checksummed by blocks."""
    out = {}
    for shard, c, entry in values_files(manifest):
        if entry.algo == fmt.CHECKSUM and not c.string:
            item = np.dtype(c.dtype).itemsize
            if not c.ragged:
                row = item * math.prod(c.shape)
                if row and rows_per_block(row) == 1:
                    out[entry.path] = row
            elif shard.num_samples and (entry.size_bytes - fmt.NPY_HEADER_BYTES) / shard.num_samples >= \
                    RAGGED_ROW_BLOCKS * BLOCK_BYTES:
                out[entry.path] = rows_per_block(item) * item
    return out


def num_blocks(size: int, block: int) -> int:
    head = fmt.NPY_HEADER_BYTES
    return 1 if size <= head else 1 + -(-(size - head) // block)


def block_span(i: int, size: int, block: int) -> tuple[int, int]:
    """Bytes [start, end) of block i of a file of `size` bytes (block 0: the header)."""
    head = fmt.NPY_HEADER_BYTES
    if i == 0:
        return 0, min(size, head)
    return head + (i - 1) * block, min(size, head + i * block)


def blocks_of(spans: np.ndarray, size: int, block: int) -> np.ndarray:
    """The blocks (sorted, unique; 0 always) that hold the byte spans [start, end) of `spans`
    ([n, 2]) of a file of `size` bytes."""
    head = fmt.NPY_HEADER_BYTES
    spans = np.asarray(spans, np.int64).reshape(-1, 2)
    spans = spans[spans[:, 1] > spans[:, 0]]
    first = (np.maximum(spans[:, 0], head) - head) // block + 1
    last = (np.maximum(spans[:, 1], head + 1) - 1 - head) // block + 1
    runs = [np.arange(a, b + 1) for a, b in zip(first.tolist(), last.tolist())]
    out = np.unique(np.concatenate([np.zeros(1, np.int64), *runs]))
    return out[out < num_blocks(size, block)]


def matches(data: bytes, size: int, entry: fmt.FileEntry) -> bool:
    digest = fmt.new_checksum()
    digest.update(data)
    return len(data) == size and digest.hexdigest() == entry.checksum


def list_bytes(manifest: fmt.Manifest) -> int:
    """Bytes of the block lists a cache entry keeps (beside its index files: never evicted)."""
    block = ranged(manifest)
    return sum(DIGEST * num_blocks(e.size_bytes, block[e.path]) for s in manifest.shards for e in s.files
               if e.path in block)
