"""The private APIs of CPython and Pillow the packer relies on, and nothing else: each is named
here once, read with a fallback where it can be missing, and checked by tests/test_internals.py
for the meaning relied on, so that a release that changes one fails that test first.

- `ProcessPoolExecutor._processes`, `._executor_manager_thread`, `._broken`: a broken pool's
  processes are killed before its shutdown is waited for (`packer.builder.pool`): CPython 3.11's
  executor can miss a worker it started while breaking and then join it forever.
- `PIL.Image._getencoder`: Pillow's raw encoder, which packs an RGB box of its 4-byte pixels in
  one copy (`packer.builder.images.rgb_pixels`); without it, crop + asarray give the same bytes.
- `soundfile._snd.sf_readf_float`, `soundfile._ffi` and `SoundFile._file`: libsndfile's own read
  on soundfile's handle, which reads an MP3 in blocks without the seek `SoundFile.read` makes
  after each (libsndfile's MP3 seek drops mpg123's bit reservoir: a click at every block's join;
  `packer.builder.audio`). There is no public way: an audio build refuses to start without it.
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


def sndfile_reads_blocks() -> bool:
    """Whether this soundfile has the binding `sndfile_read_block` uses."""
    try:
        import soundfile
    except ImportError:
        return False
    return hasattr(soundfile, "_ffi") and hasattr(getattr(soundfile, "_snd", None), "sf_readf_float")


def sndfile_read_block(f, out) -> int:
    """Up to len(out) frames of the open SoundFile `f` into the float32 [frames, channels] array
    `out`, by libsndfile's sf_readf_float, with no seek: the frames read (0 at the end).
    RuntimeError with libsndfile's reason where it reports one."""
    from soundfile import _ffi, _snd

    n = _snd.sf_readf_float(f._file, _ffi.cast("float *", out.ctypes.data), len(out))
    error = _snd.sf_error(f._file)
    if error:
        raise RuntimeError(_ffi.string(_snd.sf_error_number(error)).decode("utf-8", "replace"))
    return int(n)
