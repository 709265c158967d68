"""Decodes one image file into an HxWx3 uint8 array: the image stage of a build.

Policy (FORMAT.md, "Image pixels"): EXIF orientation applied; any mode becomes RGB, with
16-bit and 32-bit integer data rescaled to 8 bits by their real bit depth (never clipped); the shorter side resized to
S with Pillow's antialiased bilinear filter, then a centre crop of S x S (or, keep-aspect, the
whole image with its longer side capped: `packer.dataset.geometry.keep_aspect_size`). JPEGs are decoded in
draft mode at the smallest DCT scale that still leaves both sides >= 2*S (Pillow's own
`reducing_gap` for thumbnails: at 1*S the DCT-scaled pixels alias visibly, 22 dB vs 34 dB). An
image of more pixels than the build's limit (`pixel_limit`: Pillow's decompression-bomb
warning, at the limit the build sets) is an error for that file.
"""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
from PIL import Image, ImageOps

from packer.dataset.geometry import keep_aspect_size

PILLOW_MAX_PIXELS = 89_478_485  # Pillow's own Image.MAX_IMAGE_PIXELS, above which it warns of a bomb
# a build's limit: where Pillow refuses outright (twice its warning's), so a 144 MP photo packs; a
# 13,000 x 13,000 image, 0.5 GB decoded in a worker. --max-pixels sets another.
DEFAULT_MAX_PIXELS = 2 * PILLOW_MAX_PIXELS


def pixel_limit(given: int | None = None) -> int | None:
    """The pixel limit a build's workers decode with: --max-pixels where given; else the one a
    script set in Pillow (Image.MAX_IMAGE_PIXELS) before it built; else DEFAULT_MAX_PIXELS."""
    if given is not None:
        return given
    return DEFAULT_MAX_PIXELS if Image.MAX_IMAGE_PIXELS == PILLOW_MAX_PIXELS else Image.MAX_IMAGE_PIXELS
from packer.errors import SourceError
from packer.internals import raw_encoder

RESAMPLE = Image.Resampling.BILINEAR
DRAFT_GAP = 2  # draft to >= DRAFT_GAP * S; see the module docstring


DEPTHS = (8, 10, 12, 14, 16, 24, 32)  # bits a high-bit-depth sample may really have
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_flattened = 0  # images of this process whose transparency was dropped: `flattened()`


def flattened() -> int:
    """How many images this process has decoded whose transparency was dropped (no
    --background): what the build's summary counts."""
    return _flattened


def bit_depth(top: int) -> int:
    """The bits an integer image's samples really use: the smallest of DEPTHS that holds its
    largest value `top`. 10- and 12-bit sensor data in 16-bit files (and dark 16-bit images)
    keep their picture instead of being scaled into the bottom few of 255 levels; the same
    pixels give the same bytes whatever container (12-bit TIFF or 16-bit) holds them."""
    return next(d for d in DEPTHS if top < 1 << d)


def _to_rgb(img: Image.Image, background: tuple[int, int, int] | None = None) -> Image.Image:
    """Any Pillow mode to RGB. High-bit-depth integer data is scaled by its real depth
    (`bit_depth`): plain convert("RGB") clips 16-bit values to 255, which turns most such images
    white, and a fixed 65535 scale turns 12-bit data black. Transparency is dropped (Pillow's
    convert("RGB")), or, with a `background`, composited over that colour first."""
    global _flattened
    transparent = img.mode in ALPHA_MODES or "transparency" in img.info
    if background is not None and transparent:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (*background, 255)), rgba).convert("RGB")
    if transparent and background is None:  # counted only where a pixel was in fact see-through
        _flattened += "transparency" in img.info or img.getchannel(img.mode[-1]).getextrema()[0] < 255
    if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        data = np.asarray(img, dtype=np.int64)
        if data.size and data.min() < 0:
            raise SourceError(f"negative {img.mode} pixel values")
        top = (1 << bit_depth(int(data.max(initial=0)))) - 1
        data = (data * 255 + top // 2) // top
        img = Image.fromarray(data.astype(np.uint8), mode="L")
    elif img.mode == "F":
        data = np.nan_to_num(np.asarray(img, dtype=np.float64))
        img = Image.fromarray(np.clip(np.rint(data), 0, 255).astype(np.uint8), mode="L")
    return img if img.mode == "RGB" else img.convert("RGB")


def resize_box(img: Image.Image, size: int) -> tuple[Image.Image, tuple[int, int, int, int]]:
    """Shorter side to `size` (rounded); returns that image and its centre size x size box
    (left/top = floor)."""
    w, h = img.size
    scale = size / min(w, h)
    new = (max(size, round(w * scale)), max(size, round(h * scale)))
    if new != (w, h):
        img = img.resize(new, RESAMPLE)
    left, top = (new[0] - size) // 2, (new[1] - size) // 2
    return img, (left, top, left + size, top + size)


def rgb_pixels(img: Image.Image, box: tuple[int, int, int, int]) -> np.ndarray:
    """The pixels of `box` of an RGB image as a read-only HxWx3 uint8 array, packed once from
    Pillow's 4-byte-a-pixel storage by its raw encoder, which reads the box in place: crop()
    then np.array() copies them three times. Pillow's public
    crop + asarray where the encoder hook is missing: the same bytes."""
    img.load()
    shape = (box[3] - box[1], box[2] - box[0], 3)
    if raw_encoder is not None:
        e = raw_encoder("RGB", "raw", "RGB")
        try:
            e.setimage(img.im, box)
            _, status, data = e.encode(max(1, math.prod(shape)))
        finally:
            e.cleanup()
        if status == 1 and len(data) == math.prod(shape):  # 1: all of it, in one call
            return np.frombuffer(data, dtype=np.uint8).reshape(shape)
    return np.asarray(img.crop(box), dtype=np.uint8)


def decode_image(path, size: int | None, *, writable: bool = True,
                 background: tuple[int, int, int] | None = None, max_side: int | None = None) -> np.ndarray:
    """HxWx3 uint8 pixels of one file (size x size when `size` is given; with `max_side` too,
    the whole image at `keep_aspect_size`, no crop); `writable` False:
    read-only, one copy fewer (a build writes them to a file and lets go); `background`: the
    colour transparent pixels are composited over (default: alpha dropped).

    Raises SourceError with a short reason for anything Pillow cannot decode cleanly.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. corrupt EXIF: the pixels still decode
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                if size is not None and img.format == "JPEG":
                    img.draft("RGB", (size * DRAFT_GAP, size * DRAFT_GAP))
                img = ImageOps.exif_transpose(img)
                if img.width == 0 or img.height == 0:
                    raise SourceError(f"empty image ({img.width}x{img.height})")
                img = _to_rgb(img, background)
                box = (0, 0, *img.size)
                if size is not None and max_side is not None:
                    new = keep_aspect_size(*img.size, size, max_side)
                    if new != img.size:
                        img = img.resize(new, RESAMPLE)
                    box = (0, 0, *new)
                elif size is not None:
                    img, box = resize_box(img, size)
                pixels = rgb_pixels(img, box)
                return pixels.copy() if writable else pixels  # writable: callers may wrap it in a tensor
    except SourceError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        found = re.search(r"\((\d+) pixels\)", str(exc))
        raise SourceError(f"{int(found.group(1)) if found else 0:,} pixels, over the limit of {Image.MAX_IMAGE_PIXELS:,} "
                          "(a decompression bomb, or a larger photo than the limit: --max-pixels N packs it)") from None
    except Image.UnidentifiedImageError:
        raise SourceError("not an image Pillow can identify") from None
    except MemoryError:
        raise SourceError("cannot decode (out of memory: image too large)") from None
    except Exception as exc:  # noqa: BLE001 - any decoder failure is this file's skip (NotImplementedError for
        # some DDS variants, struct.error, ...), never the build's end
        message = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise SourceError(f"cannot decode ({type(exc).__name__}: {message})") from None

