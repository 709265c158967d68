"""Column encodings: a string column's bytes read as text (`decode_text`), and the JPEG lane
(FORMAT.md, "JPEG images"): an image column whose samples are stored as JPEG bytes and read as
the pixels they decode to.

`encode` runs in a build's worker processes, `decode` wherever a sample is read: a batch's
gather threads (Pillow's decoder runs outside the GIL), `MMapDataset[i]`, `packer verify`.
Pillow is imported by the first call, never by importing this module: a training process whose
datasets hold pixels loads no decoder (tests/test_layers.py).

Bytes that come from a damaged or forged dataset are an IntegrityError naming the sample, never
a crash, a hang or a huge allocation: the header's size is checked against the sample's stored
shape before a single pixel is decoded.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np

from packer.errors import ConfigError, IntegrityError

JPEG = "jpeg"  # the column encoding
DEFAULT_QUALITY = 90
# at and above this quality the chroma is kept whole (4:4:4): at 90, 4:2:0 costs about 3 dB of
# PSNR on photo crops for some 20% fewer bytes (docs/design.md, "Quality 90, chroma whole");
# below it, where bytes are what was asked for, 4:2:0
FULL_CHROMA_FROM = 90
# what a build's shard plan counts an image at, of its pixels' bytes (the plan is made before any
# decode): photos at quality 90 take a tenth to a sixth, so shards land near --shard-size
JPEG_SHARE = 1 / 7
EOI = b"\xff\xd9"  # the marker every JPEG this writer stores ends with


@dataclass(frozen=True)
class Encoded:
    """One sample of an encoded column as a writer takes it: its bytes (uint8, 1-D) and the
    shape it decodes to."""

    data: np.ndarray
    shape: tuple[int, ...]


def decode_text(raw: bytes, encoding: str, where: str) -> str:
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise IntegrityError(f"{where}: not {encoding} at byte {exc.start}; run 'packer verify'") from None


def parse_store(text: str | None) -> tuple[str, int | None]:
    """'pixels' (or None) -> ('pixels', None); 'jpeg' -> ('jpeg', 90); 'jpeg:Q' -> ('jpeg', Q)."""
    if text in (None, "pixels"):
        return "pixels", None
    name, colon, quality = str(text).partition(":")
    if name != JPEG or (colon and not quality.isdigit()) or not 1 <= int(quality or DEFAULT_QUALITY) <= 100:
        raise ConfigError(f"--store: {text!r} is not 'pixels', 'jpeg' or 'jpeg:QUALITY' (QUALITY 1..100, e.g. jpeg:90)")
    return JPEG, int(quality or DEFAULT_QUALITY)


def encode(pixels: np.ndarray, quality: int) -> Encoded:
    """HxWx3 uint8 pixels as a baseline JPEG (Pillow's libjpeg, `quality`; 4:4:4 from
    FULL_CHROMA_FROM up, else 4:2:0)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels), "RGB").save(
        buf, "JPEG", quality=quality, subsampling=0 if quality >= FULL_CHROMA_FROM else 2)
    return Encoded(np.frombuffer(buf.getbuffer(), np.uint8).copy(), tuple(pixels.shape))


# the frame headers that give a JPEG's size (SOF0-SOF15 less DHT, JPG and DAC)
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def header(data) -> tuple[int, int, int] | None:
    """(height, width, components) from a JPEG's frame header, read from its markers without
    decoding anything; None where the bytes do not hold one before the scan."""
    b = bytes(data[:1 << 16])
    if b[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 9 < len(b):
        if b[i] != 0xFF:
            return None
        marker = b[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _SOF:
            return int.from_bytes(b[i + 5:i + 7], "big"), int.from_bytes(b[i + 7:i + 9], "big"), b[i + 9]
        if marker == 0xDA:  # the scan: no frame header before it
            return None
        i += 2 + int.from_bytes(b[i + 2:i + 4], "big")
    return None


def check_header(data, shape, where: str) -> None:
    """Bytes that end a JPEG and whose frame header says RGB `shape`: what a decoder may be
    handed (a device's, which allocates what the header says); else IntegrityError."""
    h, w = int(shape[0]), int(shape[1])
    if bytes(data[-2:]) != EOI:  # libjpeg decodes a torn tail (zeros) with a warning: grey rows, no error
        raise IntegrityError(f"{where}: its JPEG bytes do not decode (no end-of-image marker: cut short or "
                             "overwritten); run 'packer verify'")
    found = header(data)
    if found != (h, w, 3):
        said = "its JPEG bytes hold no frame header" if found is None else \
            f"its JPEG header says {found[1]} x {found[0]}, {found[2]} components"
        raise IntegrityError(f"{where}: {said}, the dataset says RGB {w} x {h}; run 'packer verify'")


def decode(data, shape, where: str, out: np.ndarray | None = None) -> np.ndarray:
    """The HxWx3 uint8 pixels of one sample's JPEG bytes, which must decode to `shape`: into
    `out`'s top-left corner when given (returned as that view), else a new array. Anything else
    (truncated or garbage bytes, another size or mode in the header, a decoder failure) raises
    IntegrityError naming `where`."""
    from PIL import Image

    check_header(data, shape, where)
    h, w = int(shape[0]), int(shape[1])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=("JPEG",)) as img:
                if img.size != (w, h) or img.mode != "RGB":
                    raise IntegrityError(f"{where}: its JPEG header says {img.mode} {img.width} x {img.height}, "
                                         f"the dataset says RGB {w} x {h}; run 'packer verify'")
                img.load()
                pixels = np.asarray(img)
    except IntegrityError:
        raise
    except Exception as exc:  # noqa: BLE001 - every decoder failure on damaged bytes is this sample's error
        message = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise IntegrityError(f"{where}: its JPEG bytes do not decode ({type(exc).__name__}: {message}); "
                             "run 'packer verify'") from None
    if out is None:
        return pixels
    out[:h, :w] = pixels
    return out[:h, :w]


def image_list(data, shapes, nbytes, encoding: str, where: str) -> list[np.ndarray]:
    """The images of one sample of an image-list column (FORMAT.md section 4, "Conversations"):
    `data` its bytes, `shapes` [K, 3] and `nbytes` [K] its rows of the `image_shapes` and
    `image_nbytes` columns; pixels are views of `data`, JPEG files decoded. Any disagreement
    (bytes that do not add up, a shape that is not h x w x 3, pixels of another size, a JPEG
    that does not decode to its shape) is IntegrityError naming `where`."""
    shapes, nbytes = np.asarray(shapes), np.asarray(nbytes)
    if shapes.ndim != 2 or shapes.shape[1:] != (3,) or nbytes.shape != (len(shapes),):
        raise IntegrityError(f"{where}: {len(nbytes)} image byte counts for {len(shapes)} image shapes; "
                             "run 'packer verify'")
    if int(nbytes.sum()) != len(data) or (nbytes < 0).any():
        raise IntegrityError(f"{where}: its images' byte counts add up to {int(nbytes.sum())}, it holds {len(data)}; "
                             "run 'packer verify'")
    out, start = [], 0
    for k, (shape, n) in enumerate(zip(shapes.tolist(), nbytes.tolist())):
        h, w, c = shape
        if h < 1 or w < 1 or c != 3:
            raise IntegrityError(f"{where}: image {k} has shape {shape}, not h x w x 3; run 'packer verify'")
        piece = data[start:start + n]
        if encoding == "pixels-list":
            if n != h * w * 3:
                raise IntegrityError(f"{where}: image {k} holds {n} bytes, its shape {h} x {w} x 3 needs {h * w * 3}; "
                                     "run 'packer verify'")
            out.append(piece.reshape(h, w, 3))
        else:
            out.append(decode(piece, (h, w, 3), f"{where}: image {k}"))
        start += n
    return out


def row_images(reader, shard_pos: int, row: int, name: str = "images") -> list[np.ndarray]:
    """`image_list` of row `row` of shard `shard_pos` of a `DatasetReader`'s image-list column
    `name`, read with that shard's `image_shapes` and `image_nbytes`; errors name its file."""
    return image_list(reader.column(shard_pos, name).sample(row), reader.column(shard_pos, "image_shapes").sample(row),
                      reader.column(shard_pos, "image_nbytes").sample(row), reader.manifest.column(name).encoding,
                      f"{reader.root / reader.values_path(shard_pos, name)}: row {row}")
