"""Image bytes decoded as the packer does (`decode_bytes`, shared by bench/peers.py's adapters),
and peer dataset subclasses that do it in the loader's workers. Module level (built once, cached
here under a module-level name) so they pickle under any multiprocessing start method; a peer's
module is imported only when its class is asked for."""

from __future__ import annotations

import importlib
import io

import numpy as np
import torch

_cache: dict = {}


def decode_bytes(raw: bytes, size: int) -> np.ndarray:
    """JPEG (or any image file's) bytes decoded and resized to size x size, the packer's policy."""
    from packer.builder.images import decode_image

    return decode_image(io.BytesIO(raw), size)


def jpeg_dataset(name: str, module: str, base: str):
    """`module.base` subclassed as `name`: a `size` keyword, and `jpg` bytes in each sample
    decoded + resized to size x size (the packer's policy) into `image`."""
    if name not in _cache:
        parent = getattr(importlib.import_module(module), base)

        def __init__(self, *args, size: int, **kwargs):
            parent.__init__(self, *args, **kwargs)
            self.size = size

        def __getitem__(self, index):
            s = parent.__getitem__(self, index)
            return {"image": torch.from_numpy(decode_bytes(s["jpg"], self.size)), "label": s["label"]}

        cls = type(name, (parent,), {"__init__": __init__, "__getitem__": __getitem__, "__module__": __name__})
        globals()[name] = _cache[name] = cls
    return _cache[name]


def lit_jpeg():
    return jpeg_dataset("LitJpeg", "litdata", "StreamingDataset")


def mds_jpeg():
    return jpeg_dataset("MdsJpeg", "streaming", "StreamingDataset")
