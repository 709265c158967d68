"""`packer verify`: re-hash every file and check headers, offsets, shapes, labels and token ids.

`DatasetReader` checks sizes on open and offsets on first map (cheap); this is the full check.
It stops at the first problem and raises IntegrityError naming the file and what is wrong.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from packer.dataset import format as fmt
from packer.errors import IntegrityError
from packer.dataset.codec import decode_text, image_list
from packer.dataset.reader import check_file_sizes, check_shards_listed, load_manifest, map_column
from packer.dataset.writer import checksum_file


def verify(root: str | Path, *, on_progress=None) -> dict:
    """Returns {"files", "size_bytes", "num_samples"} when all is well."""
    root = Path(root)
    manifest = load_manifest(root)
    check_file_sizes(root, manifest.shards)  # missing or resized files, before any hashing
    check_shards_listed(root, manifest)
    files = size_bytes = 0
    total = sum(len(s.files) for s in manifest.shards)
    if manifest.inputs is not None:
        check_file_sizes(root, [fmt.Shard(0, 1, (manifest.inputs,))])
        check_hash(root / manifest.inputs.path, manifest.inputs)
    for shard in manifest.shards:
        for entry in shard.files:
            check_hash(root / entry.path, entry)
            files += 1
            size_bytes += entry.size_bytes
            if on_progress:
                on_progress(files, total)
        mapped = {}
        for column in manifest.columns:
            mapped[column.name] = arrays = map_column(root / shard.dir, column, shard.num_samples)  # headers, ...
            _check_values(root / shard.dir, manifest, column, arrays)
        _check_conversations(root / shard.dir, mapped, manifest)
    return {"files": files, "size_bytes": size_bytes, "num_samples": manifest.num_samples}


def check_hash(path: Path, entry: fmt.FileEntry) -> None:
    digest = checksum_file(path, entry.algo)
    if digest != entry.checksum:
        raise IntegrityError(f"{path}: checksum {digest[:16]}..., manifest says {entry.checksum[:16]}... "
                             f"({entry.algo})")


def _check_values(shard_dir: Path, manifest: fmt.Manifest, column: fmt.Column, arrays) -> None:
    """What a checksum cannot tell (a manifest written with wrong data): labels index the
    classes, token ids fit the vocabulary, string columns and JPEG images decode."""
    path = shard_dir / fmt.column_file_names(column)["values"]
    values = arrays.values
    if column.name in ("label", "box_labels") and manifest.classes is not None and values.size:
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= len(manifest.classes):
            raise IntegrityError(f"{path}: label {low if low < 0 else high} is outside the "
                                 f"{len(manifest.classes)} classes")
    vocab = (manifest.tokenizer or {}).get("vocab_size")
    if column.name.endswith("tokens") and isinstance(vocab, int) and values.size:
        eos = (manifest.tokenizer or {}).get("eos_id")
        top = max(vocab, eos + 1 if isinstance(eos, int) else 0)
        if int(values.max()) >= top:
            raise IntegrityError(f"{path}: token id {int(values.max())} is outside the vocabulary of {top:,}")
    if column.string:
        decode_text(np.asarray(values).tobytes(), column.encoding, str(path))
    if column.encoded:  # each image decodes to its shape
        for row in range(len(arrays.offsets) - 1):
            arrays.sample(row)


def _check_conversations(shard_dir: Path, mapped: dict, manifest: fmt.Manifest) -> None:
    """A chat shard's masks and image places (FORMAT.md 4, "Conversations"): a mask of 0s and 1s
    at its tokens' offsets; an image's placeholder inside its conversation, one per image; images
    of their own sizes where their shapes and byte counts say, a JPEG decoding to its shape."""
    for name, arrays in mapped.items():
        if not name.endswith("loss_mask"):
            continue
        path = shard_dir / f"{name}.npy"
        tokens = mapped.get(name.replace("loss_mask", "tokens"))
        if tokens is None or not np.array_equal(np.asarray(arrays.offsets), np.asarray(tokens.offsets)):
            raise IntegrityError(f"{path}: its offsets are not its tokens' (one mask byte a token)")
        if arrays.values.size and int(np.asarray(arrays.values).max()) > 1:
            raise IntegrityError(f"{path}: a loss mask byte other than 0 or 1")
    if "image_positions" in mapped:
        positions, images, tokens = mapped["image_positions"], mapped["images"], mapped["tokens"]
        path = shard_dir / "image_positions.npy"
        counts = np.diff(np.asarray(positions.offsets))
        listed = "image_shapes" in mapped  # images of their own sizes: counted by their shapes' rows
        held = np.asarray((mapped["image_shapes"] if listed else images).shapes)[:, 0]
        if not np.array_equal(counts, held):
            raise IntegrityError(f"{path}: a conversation's image places do not count its images")
        if listed:  # every image's bytes where its shape and byte count say, each JPEG decoding to its shape
            shapes, nbytes = mapped["image_shapes"], mapped["image_nbytes"]
            encoding = manifest.column("images").encoding
            for row in range(len(counts)):
                image_list(images.sample(row), shapes.sample(row), nbytes.sample(row), encoding,
                           f"{shard_dir / 'images.npy'}: row {row}")
        lengths = np.repeat(np.diff(np.asarray(tokens.offsets)), counts)
        values = np.asarray(positions.values)
        if values.size and ((values < 0) | (values >= lengths)).any():
            raise IntegrityError(f"{path}: an image placeholder outside its conversation's tokens")
