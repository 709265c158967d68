"""Peer dataset subclasses that decode JPEG bytes in the loader's workers. Module level (built
once, cached here) so they pickle under any multiprocessing start method; imported only when
the peer imports."""

from __future__ import annotations

import torch

_cache: dict = {}


def lit_jpeg():
    if "lit" not in _cache:
        import litdata

        from .peers import _decode_bytes

        class LitJpeg(litdata.StreamingDataset):
            def __init__(self, *args, size: int, **kwargs):
                super().__init__(*args, **kwargs)
                self.size = size

            def __getitem__(self, index):
                s = super().__getitem__(index)
                return {"image": torch.from_numpy(_decode_bytes(s["jpg"], self.size)), "label": s["label"]}

        globals()["LitJpeg"] = _cache["lit"] = LitJpeg
        LitJpeg.__module__, LitJpeg.__qualname__ = __name__, "LitJpeg"
    return _cache["lit"]


def mds_jpeg():
    if "mds" not in _cache:
        import streaming

        from .peers import _decode_bytes

        class MdsJpeg(streaming.StreamingDataset):
            def __init__(self, *args, size: int, **kwargs):
                super().__init__(*args, **kwargs)
                self.size = size

            def __getitem__(self, index):
                x = super().__getitem__(index)
                return {"image": torch.from_numpy(_decode_bytes(x["jpg"], self.size)), "label": x["label"]}

        globals()["MdsJpeg"] = _cache["mds"] = MdsJpeg
        MdsJpeg.__module__, MdsJpeg.__qualname__ = __name__, "MdsJpeg"
    return _cache["mds"]
