"""The columns of a dataset a user writes (`packer.Writer`, `packer.map`): declared as short
specs or taken from the first sample, and each sample's values checked and converted against
them before anything of it is written.

Specs: `"float16[*, 768]"` (ragged along its first axis, a fixed tail), `"float32[*]"`,
`"int64[4]"` (fixed), `"int64"` (a scalar), `"bool"`, `"bfloat16[*, 8]"` (stored as its bits,
read back as bfloat16), `"str"`, `"bytes"`, `"image"` (pixels, any size; `"image[224, 224]"` a
fixed size), `"jpeg"` / `"jpeg:Q"` (the JPEG lane), `"audio:RATE"` (int16 PCM; `packer.Audio`).
From a first sample: an array is ragged along its first axis with its other axes fixed (a
`[T, 80]` spectrogram, `[N, 4]` boxes; declare `"float32[512]"` for a fixed one), a Python int
`int64`, a float `float64`, a bool `bool`, a str `str`, bytes `bytes`, `packer.Image` an image,
`packer.Audio` audio. Nothing here imports torch: a torch tensor is taken through `numpy()`
(a bfloat16 one through its bits).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import numpy as np

from packer.dataset import codec
from packer.dataset import format as fmt
from packer.errors import ConfigError

NUMERIC = {"bool": "|b1", "int8": "|i1", "uint8": "|u1", "int16": "<i2", "uint16": "<u2", "int32": "<i4",
           "uint32": "<u4", "int64": "<i8", "uint64": "<u8", "float16": "<f2", "float32": "<f4", "float64": "<f8",
           "bfloat16": "<i2"}
_SPEC = re.compile(r"^\s*([a-z0-9]+)(?::(\d+))?\s*(?:\[([^\]]*)\])?\s*$")
RESERVED = ("_lengths", "_size")  # what a batch adds beside a column


@dataclass(frozen=True)
class Image:
    """An image sample: HxWx3 uint8 RGB pixels (grey HxW is made RGB), stored as pixels or,
    `store="jpeg"`, as a JPEG of them at `quality`."""

    pixels: object
    store: str = "pixels"
    quality: int = codec.DEFAULT_QUALITY


@dataclass(frozen=True)
class Audio:
    """An audio sample: [T] or [T, C] float32 in [-1, 1) or int16 PCM, at `sample_rate`."""

    samples: object
    sample_rate: int


@dataclass(frozen=True)
class Spec:
    """One column as written: its kind ("array", "string", "bytes", "image", "jpeg", "audio"),
    dtype and per-sample shape (None: ragged there), and for images/audio what they need."""

    name: str
    kind: str
    dtype: str = "|u1"
    shape: tuple = ()
    bfloat16: bool = False
    quality: int | None = None
    sample_rate: int | None = None

    def column(self) -> fmt.Column:
        if self.kind == "string":
            return fmt.Column(self.name, "|u1", (None,), encoding="utf-8")
        if self.kind == "jpeg":
            return fmt.Column(self.name, "|u1", self.shape, encoding="jpeg")
        return fmt.Column(self.name, self.dtype, self.shape, encoding="bfloat16" if self.bfloat16 else None)

    def text(self) -> str:
        """The spec as `parse` reads it back."""
        if self.kind in ("string", "bytes"):
            return "str" if self.kind == "string" else "bytes"
        if self.kind in ("image", "jpeg"):
            base = "image" if self.kind == "image" else f"jpeg:{self.quality}"
            return base + (f"[{self.shape[0]}, {self.shape[1]}]" if self.shape[0] is not None else "")
        if self.kind == "audio":
            return f"audio:{self.sample_rate}"
        name = "bfloat16" if self.bfloat16 else next(k for k, v in NUMERIC.items() if v == self.dtype)
        return name + (f"[{', '.join('*' if d is None else str(d) for d in self.shape)}]" if self.shape else "")


def check_name(name) -> None:
    if not isinstance(name, str) or not fmt.is_column_name(name) or name.endswith(RESERVED):
        raise ConfigError(f"column {name!r}: a column is named [A-Za-z_][A-Za-z0-9_]* and does not end in "
                          f"{' or '.join(RESERVED)} (a batch puts those beside a column)")


def parse(name: str, text: str) -> Spec:
    """A declared column (see the module's specs)."""
    check_name(name)
    found = _SPEC.match(str(text).lower()) if isinstance(text, str) else None
    if found is None:
        raise ConfigError(f"column {name}: {text!r} is not a column spec (e.g. 'float16[*, 768]', 'int64', 'str', "
                          "'image', 'jpeg:90', 'audio:16000')")
    base, number, dims = found.groups()
    if base in ("str", "bytes") and number is None and dims is None:
        return Spec(name, "string" if base == "str" else "bytes", "|u1", (None,))
    if base in ("image", "jpeg"):
        side = _dims(name, dims) if dims else (None, None)
        if len(side) != 2 or None in side and side != (None, None):
            raise ConfigError(f"column {name}: {text!r}: an image's size is [H, W], or none for any size")
        quality = (int(number) if number else codec.DEFAULT_QUALITY) if base == "jpeg" else None
        return Spec(name, base, "|u1", (*side, 3), quality=quality)
    if base == "audio" and number and dims is None:
        return Spec(name, "audio", "<i2", (None,), sample_rate=int(number))
    if base in NUMERIC and number is None:
        return Spec(name, "array", NUMERIC[base], _dims(name, dims) if dims else (), bfloat16=base == "bfloat16")
    raise ConfigError(f"column {name}: {text!r} is not a column spec (e.g. 'float16[*, 768]', 'int64', 'str', "
                      "'image', 'jpeg:90', 'audio:16000')")


def _dims(name: str, text: str) -> tuple:
    parts = [p.strip() for p in text.split(",")] if text.strip() else []
    try:
        dims = tuple(None if p == "*" else int(p) for p in parts)
    except ValueError:
        raise ConfigError(f"column {name}: [{text}]: dimensions are numbers, or * for the first one") from None
    if None in dims[1:] or any(d is not None and d < 0 for d in dims):
        raise ConfigError(f"column {name}: [{text}]: only the first dimension may be * (ragged)")
    return dims


def infer(name: str, value) -> Spec:
    """The column a first sample's value makes (see the module)."""
    check_name(name)
    if isinstance(value, Image):
        return Spec(name, "jpeg" if value.store == "jpeg" else "image", "|u1", (None, None, 3),
                    quality=value.quality if value.store == "jpeg" else None)
    if isinstance(value, Audio):
        return Spec(name, "audio", "<i2", (None,) if np.ndim(value.samples) == 1 else (None, np.shape(value.samples)[1]),
                    sample_rate=int(value.sample_rate))
    if isinstance(value, str):
        return Spec(name, "string", "|u1", (None,))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return Spec(name, "bytes", "|u1", (None,))
    if isinstance(value, (bool, np.bool_)):
        return Spec(name, "array", "|b1")
    if isinstance(value, (int, np.integer)):
        return Spec(name, "array", "<i8" if isinstance(value, int) else np.dtype(value.dtype).newbyteorder("<").str)
    if isinstance(value, float):
        return Spec(name, "array", "<f8")
    array, bfloat16 = as_array(value, name)
    dtype = array.dtype.newbyteorder("<").str if array.dtype.itemsize > 1 else array.dtype.str
    if dtype not in fmt.DTYPES:
        raise ConfigError(f"column {name}: dtype {array.dtype} is not one a column holds ({', '.join(NUMERIC)})")
    shape = (None, *array.shape[1:]) if array.ndim else ()
    return Spec(name, "array", dtype, shape, bfloat16=bfloat16)


def as_array(value, name: str) -> tuple[np.ndarray, bool]:
    """A numpy array of a value (a torch tensor through numpy(); a bfloat16 one as its int16
    bits), and whether it holds bfloat16."""
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":  # numpy has no bfloat16: its bits, as int16
            return value.view(sys.modules["torch"].int16).numpy(), True  # (torch is loaded: a tensor is here)
        value = value.numpy()
    try:
        return np.asarray(value), False
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"column {name}: {type(value).__name__} is not an array ({exc})") from None


def convert(spec: Spec, value, where: str):
    """A sample's value as its column stores it (an array, or a JPEG's `codec.Encoded`); a
    ConfigError naming the sample and the column for a value that does not fit."""
    bad = f"{where}: column {spec.name}"
    if spec.kind in ("string", "bytes"):
        if spec.kind == "string" and not isinstance(value, str):
            raise ConfigError(f"{bad} holds text, not {type(value).__name__}")
        if spec.kind == "bytes" and not isinstance(value, (bytes, bytearray, memoryview)):
            raise ConfigError(f"{bad} holds bytes, not {type(value).__name__}")
        raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)
        return np.frombuffer(raw, np.uint8)
    if spec.kind in ("image", "jpeg"):
        return _image(spec, value, bad)
    if spec.kind == "audio":
        return _audio(spec, value, bad)
    array, bfloat16 = as_array(value, spec.name)
    if bfloat16 != spec.bfloat16:
        raise ConfigError(f"{bad} is {'bfloat16' if spec.bfloat16 else np.dtype(spec.dtype).name}, "
                          f"not {'bfloat16' if bfloat16 else array.dtype}")
    if array.dtype != np.dtype(spec.dtype) and not np.can_cast(array.dtype, spec.dtype, casting="same_kind"):
        raise ConfigError(f"{bad} is {np.dtype(spec.dtype).name}, not {array.dtype} (cast it first)")
    if array.dtype.kind != np.dtype(spec.dtype).kind:  # int into float, float into int: not silently
        raise ConfigError(f"{bad} is {np.dtype(spec.dtype).name}, not {array.dtype} (cast it first)")
    _fits(spec, array.shape, bad)
    target = np.dtype(spec.dtype)
    if target.kind in "iu" and array.size and not np.can_cast(array.dtype, target, casting="safe"):
        info = np.iinfo(target)  # a narrower integer: its values must fit, not wrap
        if int(array.min()) < info.min or int(array.max()) > info.max:
            raise ConfigError(f"{bad} is {target.name}: {int(array.min())}..{int(array.max())} does not fit it")
    return np.asarray(array, dtype=target, order="C")  # (ascontiguousarray makes a scalar 1-d)


def _fits(spec: Spec, shape: tuple, bad: str) -> None:
    want = spec.shape
    if len(shape) != len(want) or any(w is not None and w != g for g, w in zip(shape, want)):
        shown = [("*" if w is None else w) for w in want]
        raise ConfigError(f"{bad} takes shape {shown}, not {list(shape)} (declare it in columns= where it varies)")


def _image(spec: Spec, value, bad: str):
    pixels = value.pixels if isinstance(value, Image) else value
    array, _ = as_array(pixels, spec.name)
    if array.ndim == 2:
        array = np.repeat(array[:, :, None], 3, axis=2)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise ConfigError(f"{bad} takes H x W x 3 uint8 RGB pixels, not {array.dtype} {list(array.shape)}")
    _fits(spec, array.shape, bad)
    array = np.ascontiguousarray(array)
    return codec.encode(array, spec.quality) if spec.kind == "jpeg" else array


def _audio(spec: Spec, value, bad: str) -> np.ndarray:
    if not isinstance(value, Audio):
        raise ConfigError(f"{bad} holds audio: packer.Audio(samples, sample_rate)")
    if value.sample_rate != spec.sample_rate:
        raise ConfigError(f"{bad} is at {spec.sample_rate:,} Hz, not {value.sample_rate:,} (resample it first)")
    array, _ = as_array(value.samples, spec.name)
    if array.dtype.kind == "f":  # as an audio build stores it: FORMAT.md 4, "Audio samples"
        array = np.clip(np.rint(np.nan_to_num(array.astype(np.float32)) * 32768.0), -32768, 32767)
    elif array.dtype != np.int16:
        raise ConfigError(f"{bad} takes float32 in [-1, 1) or int16 samples, not {array.dtype}")
    _fits(spec, array.shape, bad)
    return np.ascontiguousarray(array, dtype="<i2")
