"""The private APIs of CPython and Pillow the packer relies on, and nothing else: each is named
here once, read with a fallback where it can be missing, and checked by tests/test_internals.py
for the meaning relied on, so that a release that changes one fails that test first.

- `ProcessPoolExecutor._processes`, `._executor_manager_thread`, `._broken`: a broken pool's
  processes are killed before its shutdown is waited for (`packer.builder.pool`): CPython 3.11's
  executor can miss a worker it started while breaking and then join it forever.
- `PIL.Image._getencoder`: Pillow's raw encoder, which packs an RGB box of its 4-byte pixels in
  one copy (`packer.builder.images.rgb_pixels`); without it, crop + asarray give the same bytes.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

from PIL import Image

raw_encoder = getattr(Image, "_getencoder", None)  # None: the public path serves


def pool_processes(executor: ProcessPoolExecutor) -> list:
    """The executor's worker processes (multiprocessing.Process objects); [] if it hides them."""
    return list((getattr(executor, "_processes", None) or {}).values())


def pool_manager(executor: ProcessPoolExecutor):
    """The executor's manager thread, or None."""
    return getattr(executor, "_executor_manager_thread", None)


def pool_broken(executor: ProcessPoolExecutor) -> bool:
    """Whether a worker of the executor died (it accepts no more work)."""
    return bool(getattr(executor, "_broken", False))
