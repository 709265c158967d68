"""Peer formats, each fed the same data through its own writer and read with its own loader.

Two variants per peer where the peer allows both: "decoded" stores the very pixels mmpack
stores (224x224x3 uint8 read from the mmpack dataset, so format is compared with format), and
"jpeg" stores the original image files and decodes + resizes them in the loader's workers,
the peer's usual use. Every adapter imports its peer lazily; one that is missing or fails to
import becomes a row saying so, never an error of the bench.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ._peer_classes import decode_bytes, lit_jpeg, mds_jpeg
from .measure import dir_bytes

# DataLoaders here use the platform's default start method (fork on Linux) explicitly: some
# peers change the process-wide default on import, which would tax every later row.
MP_CONTEXT = multiprocessing.get_start_method(allow_none=False)
PIP = {"webdataset": "webdataset", "litdata": "litdata", "streaming": "mosaicml-streaming", "datasets": "datasets"}
NAMES = {"webdataset": "WebDataset", "litdata": "LitData", "streaming": "MosaicML Streaming", "datasets": "HF datasets"}


def availability(module: str) -> str | None:
    """None when the peer imports, else the reason (not installed, or installed but broken)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return "not installed: pip install -r bench/peers-requirements.txt (in a venv of its own: see that file)"
        return f"installed, but import fails: {exc}"
    except Exception as exc:  # noqa: BLE001 - a broken peer install is a row, not a crash
        return f"installed, but import fails: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return None


@dataclass
class Source:
    """The bench's images: decoded pixels from the mmpack dataset and the raw files."""

    dataset: object  # loaders.MMapDataset over image/label
    files: list[Path]  # raw file of sample i
    labels: list[int]
    size: int


@dataclass
class PeerSystem:
    name: str
    convert: Callable[[Path], None]
    loader: Callable[[Path], Iterable]
    count_of: Callable
    jpeg: bool


class DecodePair:
    """(jpeg bytes or pixels, label) -> (uint8 HWC tensor, int); picklable for any start method."""

    def __init__(self, size: int | None):
        self.size = size

    def __call__(self, pair):
        image, label = pair
        pixels = decode_bytes(image, self.size) if self.size else image
        return torch.from_numpy(pixels), int(label)


class DecodeBatch:
    """HF `with_transform`: a batch of JPEG bytes -> decoded, resized tensors."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, batch):
        return {"image": [torch.from_numpy(decode_bytes(im["bytes"], self.size)) for im in batch["image"]],
                "label": batch["label"]}


def _decoded(src: Source, i: int) -> tuple[np.ndarray, int]:
    s = src.dataset[i]
    return s["image"].numpy(), int(s["label"])


def _n_shards(n: int) -> int:
    return max(4, n // 500)


# -- WebDataset ------------------------------------------------------------------------------
def webdataset_systems(src: Source, bs: int, workers: int) -> list[PeerSystem]:
    import webdataset as wds

    n = len(src.files)

    def convert(jpeg: bool):
        def run(out: Path) -> None:
            out.mkdir(parents=True, exist_ok=True)
            with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=-(-n // _n_shards(n)), verbose=0) as sink:
                for i in range(n):
                    if jpeg:
                        sink.write({"__key__": f"{i:08d}", "jpg": src.files[i].read_bytes(), "cls": src.labels[i]})
                    else:
                        image, label = _decoded(src, i)
                        sink.write({"__key__": f"{i:08d}", "npy": image, "cls": label})
        return run

    def loader(jpeg: bool):
        def make(out: Path):
            urls = sorted(str(p) for p in out.glob("shard-*.tar"))
            pipe = wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False).shuffle(1000)
            if jpeg:
                pipe = pipe.to_tuple("jpg", "cls").map(DecodePair(src.size))
            else:
                pipe = pipe.decode().to_tuple("npy", "cls").map(DecodePair(None))
            pipe = pipe.batched(bs)
            return torch.utils.data.DataLoader(pipe, batch_size=None, num_workers=workers, pin_memory=_pin(),
                                               multiprocessing_context=MP_CONTEXT if workers else None)
        return make

    return [PeerSystem(f"WebDataset {'JPEG' if j else 'decoded'} tar + DataLoader({workers} workers)",
                       convert(j), loader(j), lambda b: len(b[1]), j) for j in (False, True)]


# -- LitData ---------------------------------------------------------------------------------
class _LitSource:
    """litdata.optimize's fn: picklable, opens the mmpack dataset lazily in each worker."""

    def __init__(self, root: str, files: list[str], labels: list[int], jpeg: bool):
        self.root, self.files, self.labels, self.jpeg, self._ds = root, files, labels, jpeg, None

    def __call__(self, i: int) -> dict:
        if self.jpeg:
            return {"jpg": Path(self.files[i]).read_bytes(), "label": self.labels[i]}
        if self._ds is None:
            from loaders import MMapDataset

            self._ds = MMapDataset(self.root, columns=["image", "label"])
        s = self._ds[i]
        return {"image": s["image"].numpy().copy(), "label": int(s["label"])}


def litdata_systems(src: Source, bs: int, workers: int) -> list[PeerSystem]:
    import litdata

    JpegStreaming = lit_jpeg()

    def convert(jpeg: bool):
        def run(out: Path) -> None:
            fn = _LitSource(str(src.dataset.root), [str(f) for f in src.files], src.labels, jpeg)
            litdata.optimize(fn=fn, inputs=list(range(len(src.files))), output_dir=str(out), chunk_bytes="64MB",
                             num_workers=workers, mode="overwrite")
        return run

    def loader(jpeg: bool):
        def make(out: Path):
            ds = JpegStreaming(str(out), shuffle=True, size=src.size) if jpeg else litdata.StreamingDataset(str(out), shuffle=True)
            return litdata.StreamingDataLoader(ds, batch_size=bs, num_workers=workers, pin_memory=_pin(),
                                               multiprocessing_context=MP_CONTEXT if workers else None)
        return make

    return [PeerSystem(f"LitData {'JPEG' if j else 'decoded'} + StreamingDataLoader({workers} workers)",
                       convert(j), loader(j), lambda b: len(b["label"]), j) for j in (False, True)]


# -- MosaicML Streaming (MDS) ----------------------------------------------------------------
def streaming_systems(src: Source, bs: int, workers: int) -> list[PeerSystem]:
    import streaming

    s, JpegMDS = src.size, mds_jpeg()

    def convert(jpeg: bool):
        def run(out: Path) -> None:
            columns = {"jpg": "bytes", "label": "int"} if jpeg else {"image": f"ndarray:uint8:{s},{s},3", "label": "int"}
            with streaming.MDSWriter(out=str(out), columns=columns, size_limit=1 << 26) as sink:
                for i in range(len(src.files)):
                    if jpeg:
                        sink.write({"jpg": src.files[i].read_bytes(), "label": src.labels[i]})
                    else:
                        image, label = _decoded(src, i)
                        sink.write({"image": image, "label": label})
        return run

    def loader(jpeg: bool):
        def make(out: Path):
            ds = (JpegMDS(local=str(out), shuffle=True, batch_size=bs, size=s) if jpeg
                  else streaming.StreamingDataset(local=str(out), shuffle=True, batch_size=bs))
            return torch.utils.data.DataLoader(ds, batch_size=bs, num_workers=workers, pin_memory=_pin(),
                                               multiprocessing_context=MP_CONTEXT if workers else None)
        return make

    return [PeerSystem(f"MosaicML MDS {'JPEG' if j else 'decoded'} + DataLoader({workers} workers)",
                       convert(j), loader(j), lambda b: len(b["label"]), j) for j in (False, True)]


# -- Hugging Face datasets (Arrow) -------------------------------------------------------------
def datasets_systems(src: Source, bs: int, workers: int) -> list[PeerSystem]:
    import datasets as hf

    s = src.size

    def convert(jpeg: bool):
        def rows():
            for i, (f, label) in enumerate(zip(src.files, src.labels)):
                image = {"bytes": f.read_bytes(), "path": None} if jpeg else _decoded(src, i)[0]
                yield {"image": image, "label": label}

        def run(out: Path) -> None:
            image = hf.Image(decode=False) if jpeg else hf.Array3D((s, s, 3), "uint8")
            features = hf.Features({"image": image, "label": hf.Value("int64")})
            ds = hf.Dataset.from_generator(rows, features=features, cache_dir=str(out.parent / f"hf-cache-{out.name}"))
            ds.save_to_disk(str(out))
        return run

    def loader(jpeg: bool):
        def make(out: Path):
            ds = hf.load_from_disk(str(out))
            ds = ds.with_transform(DecodeBatch(s)) if jpeg else ds.with_format("torch")
            return torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=True, num_workers=workers, pin_memory=_pin(),
                                               multiprocessing_context=MP_CONTEXT if workers else None)
        return make

    return [PeerSystem(f"HF datasets {'JPEG' if j else 'decoded'} Arrow + DataLoader({workers} workers)",
                       convert(j), loader(j), lambda b: len(b["label"]), j) for j in (False, True)]


ADAPTERS = {"webdataset": webdataset_systems, "litdata": litdata_systems, "streaming": streaming_systems,
            "datasets": datasets_systems}


def _pin() -> bool:
    return torch.cuda.is_available()


def timed_convert(system: PeerSystem, out: Path) -> dict:
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # peers print progress; stdout is the table's
        system.convert(out)
    seconds = time.perf_counter() - start
    return {"convert_s": seconds, "disk_bytes": dir_bytes(out)}
