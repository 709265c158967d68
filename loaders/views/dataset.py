"""`MMapDataset`: map-style access to a dataset dir (its iterable twin is in
`loaders.views.iterable`).

`ds[i]` is a dict of fresh tensors, copied out of the read-only maps, as ImageFolder's are: a
transform that edits a sample in place (a cutout, a normalisation) changes that copy only, never
what a later `ds[i]` returns. Token ids (uint16 / uint32 on disk) come out as int64
(`loaders.batch.gather.batch_dtype`). Whole batches (`Loader`, `ds.batched`) are one gather each, not
a copy per sample. Pickles as its path and generation; each DataLoader worker re-maps that very
build lazily (a rebuild of the dir meanwhile does not change what it reads) and shares the page
cache with every other process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from packer.dataset.format import Column, Manifest
from packer.dataset.codec import decode_text, row_images
from packer.dataset.reader import DatasetReader
from packer.errors import ConfigError
from packer.remote.traffic import FIELDS

from loaders.batch.canvas import images_canvas
from loaders.batch.gather import ColumnGather, batch_dtype
from loaders.batch.source import Batchable
from loaders.batched import BatchedDataset


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A copy of a sample (or a 0-d scalar) of the read-only map, in the batch dtype (token ids
    int64): the caller's to change."""
    return torch.from_numpy(np.array(array, dtype=batch_dtype(array.dtype)))


def resolve_root(root: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A dataset dir as is; an archive unpacked into the cache (once), or a dataset in object
    storage (an s3:// URL) downloaded and verified into the node's cache (once), and that dir."""
    from packer import remote
    from packer.dataset.archive import is_archive, materialize

    if remote.is_url(root):
        return remote.materialize(root, cache_dir)
    return materialize(root, cache_dir)[0] if is_archive(root) else Path(root)


class Reopens:
    """A view pickled by its arguments (its public attributes, the generation it opened among
    them) and opened again by `_open()` where it is unpickled: a DataLoader worker maps the same
    build, never the maps themselves."""

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_") and k != "source_id"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()


class MMapDataset(torch.utils.data.Dataset, Batchable):
    """A packed dataset dir as a map-style dataset.

    Args:
        root: the dataset dir written by `packer build`, or an archive from `packer pack`.
        columns: the columns to return (default: all).
        cache_dir: where an archive is unpacked, once, on first open (safe when several
            processes open it at once); default `$MMPACK_CACHE` or ~/.cache/mmpack/archives;
            for an s3:// URL, the node's cache of remote datasets (default
            ~/.cache/mmpack/remote), whose shards are fetched as they are first read (a
            `Loader` fetches them ahead) and shared by the node's processes.
        cache_limit: for an s3:// URL, the most bytes its cache entry may hold (an int, or a
            string such as "20GB" or "512MiB"); shards no reader maps are evicted, the one used
            farthest ahead first. None: no limit. Too small a limit is refused with what it needs.
        padding_value: what follows each sample of a ragged 1-D column (tokens) in a batch, up
            to the batch's longest (`Loader`, `ds.batched`); `tokens_lengths` says where it
            starts. Default 0, which is a real token of many vocabularies: pass your pad id, or
            use the lengths. (Images of different sizes are padded with black, see `_size`.)
    """

    def __init__(self, root: str | Path, *, columns: list[str] | None = None, cache_dir: str | Path | None = None,
                 padding_value: int = 0, cache_limit: int | str | None = None):
        from packer import remote

        self._cache = None
        if remote.is_url(root):
            self._cache = remote.open_cached(root, cache_dir, remote.parse_limit(cache_limit))
            self.root = self._cache.root
        elif cache_limit is not None:
            raise ConfigError(f"{root}: cache_limit is for datasets in object storage (s3:// and az:// URLs); "
                              "a local dataset is never a cache")
        else:
            self.root = resolve_root(root, cache_dir)
        self.padding_value = padding_value
        self._reader: DatasetReader | None = DatasetReader(self.root, cache=self._cache)
        self._generation = self._reader.generation  # what a worker re-opens: this very build
        self._reader.check_columns(columns or ())
        self._names = list(columns) if columns else [c.name for c in self._reader.manifest.columns]

    @property
    def reader(self) -> DatasetReader:
        if self._reader is None:  # first use after unpickling in a worker
            self._reader = DatasetReader(self.root, self._generation, self._cache)
        return self._reader

    @property
    def bytes_downloaded(self) -> int:
        """Bytes this process has fetched from object storage for this dataset's shards (0 for a
        local dataset)."""
        return self._cache.here().downloaded if self._cache is not None else 0

    @property
    def traffic(self) -> dict:
        """What this process fetched from object storage for this dataset's shards: the bytes,
        the GET requests (a range is one; the client's own retries are not counted), the shards
        it downloaded, and the times a shard it needed was in the node's cache already (fetched
        by another process, an earlier run, or itself before). Zeros for a local dataset."""
        return dict(self._cache.here().traffic.mine) if self._cache is not None else dict.fromkeys(FIELDS, 0)

    @property
    def node_traffic(self) -> dict:
        """`traffic` added up over every process on this node that read this dataset's cache
        entry (DataLoader workers, ranks, earlier runs): what `bench doctor` reports."""
        return self._cache.here().traffic.node() if self._cache is not None else dict.fromkeys(FIELDS, 0)

    @property
    def manifest(self) -> Manifest:
        return self.reader.manifest

    @property
    def columns(self) -> dict[str, Column]:
        return {c.name: c for c in self.manifest.columns if c.name in self._names}

    @property
    def classes(self) -> list[str] | None:
        classes = self.manifest.classes
        return list(classes) if classes is not None else None

    @property
    def class_to_idx(self) -> dict[str, int] | None:
        """ImageFolder's: each class's label, by its folder name; None without classes."""
        classes = self.classes
        return {name: i for i, name in enumerate(classes)} if classes is not None else None

    @property
    def targets(self) -> np.ndarray | None:
        """ImageFolder's `targets`: every sample's label in sample order, as an int64 array (a list
        in ImageFolder; here 8 bytes a sample, read from the label column when asked); None
        without labels (text, a flat folder)."""
        return self.reader.labels()

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, index: int) -> dict:
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"MMapDataset indices must be integers, not {type(index).__name__}")
        shard, row = self.reader.locate(int(index))
        out = {}
        for name in self._names:
            col = self.manifest.column(name)
            value = self.reader.column(shard, name).sample(row)
            if col.string:
                out[name] = decode_text(bytes(value), col.encoding, f"{self.root}: column {name} of sample {index}")
            elif col.image_list:  # a conversation's images of their own sizes: a canvas and each's size
                out |= images_canvas(name, row_images(self.reader, shard, row, name))
            else:
                out[name] = _tensor(value).view(torch.bfloat16) if col.bfloat16 else _tensor(value)
        if self._cache is not None and self._cache.limit is not None:
            self.reader.release(shard)  # under a limit a sample's shard stays pinned only while it is read
        return out

    def batch_source(self, columns: list[str] | None = None, *, device_decode: bool = False) -> ColumnGather:
        """A batch gather over `columns` (default: this dataset's), a loader's own; with
        `device_decode`, one that hands the JPEG lane over as bytes, for its device to decode."""
        return ColumnGather(self.reader, list(columns) if columns else self._names, self.padding_value,
                            device_decode=device_decode)

    def batched(self, batch_size: int | None = None, **kwargs):
        """Whole batches for an existing DataLoader (see `loaders.BatchedDataset`)."""
        return BatchedDataset(self, batch_size, **kwargs)

    def __getstate__(self) -> dict:
        return {"root": str(self.root), "names": self._names, "generation": self._generation,
                "padding_value": self.padding_value, "cache": self._cache}

    def __setstate__(self, state: dict) -> None:
        self.root, self._names, self._reader = Path(state["root"]), state["names"], None
        self._generation, self.padding_value = state.get("generation"), state.get("padding_value", 0)
        self._cache = state.get("cache")

    def __repr__(self) -> str:
        return f"MMapDataset({str(self.root)!r}, samples={len(self)}, columns={self._names})"

