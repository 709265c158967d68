"""mmpack's offline packer: raw images and text -> memory-mapped numpy shards + a manifest.

`packer.build / commit / push / pull / verify / info / show / merge / pack / unpack / sizes` do what
the `packer` command does (`packer.api`); `packer.map`, `packer.Writer` (with `packer.Image`,
`packer.Audio`) write what a user computes. Never imports torch. `loaders` reads what this writes,
through `packer.dataset.reader` (and `packer.remote` for URLs); names are imported lazily so
that reading does not pull in Pillow, tokenizers or pyarrow.
"""

from __future__ import annotations

import importlib

__version__ = "0.7.0"

_EXPORTS = {
    **{name: "api" for name in ("build", "commit", "push", "pull", "verify", "info", "show", "merge", "pack",
                                "unpack", "sizes", "map")},
    "Writer": "samples.writer", "Image": "samples.schema", "Audio": "samples.schema",
    "BuildConfig": "builder.config", "DatasetReader": "dataset.reader", "load_manifest": "dataset.reader",
    "MmpackError": "errors", "ConfigError": "errors", "SourceError": "errors",
    "ManifestError": "errors", "IntegrityError": "errors",
}
__all__ = sorted(_EXPORTS)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'packer' has no attribute {name!r}")
