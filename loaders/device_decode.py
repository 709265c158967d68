"""The JPEG lane decoded on the GPU: with `Loader(..., device="cuda", jpeg_decode="device")`
and torchvision's nvJPEG decode, the gather hands each batch's JPEG bytes (`JpegBatch`, `loaders.batch.decode.jpeg_bytes`:
one take per shard on the host, each sample's header checked against its stored shape there),
and after the Loader's copy stage one batched call decodes them on the device into the batch the
pixel lane gives: uint8 [B, S, S, 3], or the canvas [B, Hmax, Wmax, 3] and `{name}_size`. So
`train_transform` and everything after it is unchanged, and the host does no pixel work.

`decoder()` is torchvision.io.decode_jpeg on a list (batched nvJPEG, torchvision >= 0.19);
`decoded_on` takes any decode(list of uint8 byte tensors, device) -> list of [3, h, w] tensors,
which lets the tests drive it on the CPU with Pillow.
"""

from __future__ import annotations

import numpy as np
import torch

from packer.errors import ConfigError, IntegrityError

from loaders.batch.decode import JpegBatch

MODES = ("auto", "threads", "device")
# What "auto" picks on a CUDA device. The batched decode on the card has not yet run on a GPU
# beside the threads' decode (the `cuda` test in tests/loaders/test_jpeg_lane.py, and its rate
# in bench/results): until it has, equal and faster, "auto" is the threads' decode, which every
# test runs, and the card is asked for by name ("device").
AUTO_ON_CUDA = "threads"

def decoder():
    """torchvision's batched nvJPEG decode as decode(pieces, device), or None without it."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError:
        return None
    return lambda pieces, device: decode_jpeg(pieces, mode=ImageReadMode.RGB, device=device)


def choose(mode: str, device, encoded: bool):
    """The decode after the copy stage, on the Loader's device (None: the gather's threads
    decode with Pillow). "auto": AUTO_ON_CUDA on a CUDA device, the threads elsewhere; "device":
    torchvision's on whatever the device is (nvJPEG on a CUDA device, its CPU decoder without
    one), or a ConfigError when it is not installed; "threads": none."""
    if mode not in MODES:
        raise ConfigError(f"jpeg_decode={mode!r} is not one of {', '.join(MODES)}")
    if mode == "auto":
        on_cuda = device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()
        mode = AUTO_ON_CUDA if on_cuda else "threads"
    if not encoded or mode == "threads":
        return None
    decode = decoder()
    if decode is None and mode == "device":
        raise ConfigError("jpeg_decode='device' needs torchvision's decode_jpeg (pip install torchvision; nvJPEG on "
                          "a CUDA device); without it leave it 'auto': the Loader's threads decode with Pillow")
    return decode


def decoded_on(batches, device, decode):
    """`batches` with each JpegBatch decoded on `device` (None: the CPU) by `decode`."""
    device = torch.device(device if device is not None else "cpu")
    for batch in batches:
        if isinstance(batch, dict) and any(isinstance(v, JpegBatch) for v in batch.values()):
            out = {}
            for k, v in batch.items():
                out.update(decode_batch(v, device, decode) if isinstance(v, JpegBatch) else {k: v})
            batch = out
        yield batch


def decode_batch(jb: JpegBatch, device, decode) -> dict:
    """{name: the pixel lane's batch on `device`} (and `{name}_size` for own-sized images)."""
    pieces = [jb.data[a:b] for a, b in zip(jb.offsets[:-1], jb.offsets[1:])]
    try:
        images = decode(pieces, device)
    except RuntimeError:  # which sample: the batch's first that fails alone
        for i, piece in enumerate(pieces):
            try:
                decode([piece], device)
            except RuntimeError as exc:
                raise IntegrityError(f"{jb.where[i]}: its JPEG bytes do not decode on {device} "
                                     f"({str(exc).splitlines()[0][:200]}); run 'packer verify'") from None
        raise
    for i, image in enumerate(images):
        h, w = int(jb.shapes[i][0]), int(jb.shapes[i][1])
        if tuple(image.shape) != (3, h, w):
            raise IntegrityError(f"{jb.where[i]}: its JPEG decodes to {tuple(image.shape[1:])} x "
                                 f"{image.shape[0]}, the dataset says {h} x {w} x 3; run 'packer verify'")
    n = len(images)
    if jb.fixed:
        if not n:
            return {jb.name: torch.empty((0, 0, 0, 3), dtype=torch.uint8, device=device)}
        return {jb.name: torch.stack(images).permute(0, 2, 3, 1).contiguous()}
    top = jb.shapes.max(axis=0, initial=0) if n else np.zeros(3, np.int64)
    canvas = torch.zeros((n, int(top[0]), int(top[1]), 3), dtype=torch.uint8, device=device)
    for i, image in enumerate(images):
        canvas[i, :image.shape[1], :image.shape[2]] = image.permute(1, 2, 0)
    sizes = torch.as_tensor(np.ascontiguousarray(jb.shapes[:, :2]), dtype=torch.int64).to(device)
    return {jb.name: canvas, f"{jb.name}_size": sizes}
