"""FORMAT.md sections 3 and 4: column files are NPY 1.0 with a fixed-length header (what the
writer streams rows behind), and the dtype choices."""

from __future__ import annotations

import ast
import threading
import warnings

import numpy as np

# -- 3. Column files: NPY v1.0 with a fixed-length header -----------------------------------
NPY_HEADER_BYTES = 128  # magic(6) + version(2) + header_len(2) + dict padded with spaces + "\n"
NPY_MAGIC = b"\x93NUMPY\x01\x00"
OFFSETS_DTYPE = "<i8"
SHAPES_DTYPE = "<i8"


def npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """A standard NPY 1.0 header padded to exactly NPY_HEADER_BYTES, so a writer can stream rows
    behind a placeholder and rewrite the header in place once the row count is known."""
    descr = np.dtype(dtype).str
    text = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (descr, tuple(shape))
    body_len = NPY_HEADER_BYTES - len(NPY_MAGIC) - 2
    if len(text) + 1 > body_len:
        raise ValueError(f"NPY header for shape {shape} does not fit {NPY_HEADER_BYTES} bytes")
    body = text.ljust(body_len - 1).encode("latin1") + b"\n"
    return NPY_MAGIC + body_len.to_bytes(2, "little") + body


# ast.literal_eval and warnings.catch_warnings change interpreter-wide state: threads reading
# headers at once (unpack, verify, the remote cache's restores) take turns. On CPython 3.11 a
# collection during one thread's parse let another's corrupt the AST depth count: "SystemError:
# AST constructor recursion depth mismatch" (CPython gh-106905).
_HEADER_LOCK = threading.Lock()


def parse_npy_header(raw: bytes) -> tuple[str, tuple[int, ...]]:
    """(dtype str, shape) of a header written by npy_header; ValueError when it is not one."""
    if len(raw) < NPY_HEADER_BYTES or raw[:8] != NPY_MAGIC:
        raise ValueError("not an NPY 1.0 file")
    body_len = int.from_bytes(raw[8:10], "little")
    if body_len != NPY_HEADER_BYTES - 10:
        raise ValueError(f"NPY header is {body_len + 10} bytes, expected {NPY_HEADER_BYTES}")
    try:
        with _HEADER_LOCK:
            header = ast.literal_eval(raw[10:NPY_HEADER_BYTES].decode("latin1").strip())
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)  # e.g. a flipped bit: "<i8" -> "<a8"
                return np.dtype(header["descr"]).str, tuple(int(n) for n in header["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError, DeprecationWarning) as exc:
        raise ValueError(f"unreadable NPY header ({exc})") from None


# -- 4. Dtype choices -----------------------------------------------------------------------
def choose_token_dtype(vocab_size: int) -> str:
    """uint16 when every id (0 .. vocab_size-1) fits, else uint32: half the bytes for the usual
    30k-65k vocabularies."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return "<u2" if vocab_size <= 1 << 16 else "<u4"
