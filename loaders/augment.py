"""Whole-batch image transforms on the device the batch is on, so the CPU does none.

`train_transform` is torchvision's `RandomResizedCrop(size)` + `RandomHorizontalFlip()` +
`ToTensor()` + `Normalize(mean, std)`, and `eval_transform` its `Resize(resize)` +
`CenterCrop(size)` + the same normalisation, over a uint8 canvas [B, H, W, 3] in which sample b
fills the top-left sizes[b] = (h, w) (what `Loader` gives for a keep-aspect dataset; a fixed-size
batch is its own canvas). Per sample and for the whole batch at once:

- crop boxes follow torchvision's `RandomResizedCrop.get_params` (up to 10 draws of area and
  log-aspect against the sample's own (h, w), then its centre-crop fallback): `rrc_boxes`;
- the resize is torch's `interpolate(mode="bilinear", antialias=True, align_corners=False)` of
  the crop (Pillow's bilinear filter, which widens with the shrink factor), so a sample's
  padding is never read; the flip costs no extra pass;
- normalisation and the cast to `dtype` happen once, on the small output.

On CUDA the resize is two separable passes, one per axis, each one batched matrix product in
float16 built from every sample's interpolation taps (tensor cores; pixel values are exact in
float16 and the result is within 0.1 of a level; the flip is the horizontal taps reversed). The
boxes and taps are worked out on the host and sent in one copy, so a call is about ten kernel
launches whatever the batch size (`bench augment` counts them). Elsewhere the resize is torch's
own interpolate per sample, whose uint8 kernel beats any batched float formulation on a CPU
(docs/design.md).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
ATTEMPTS = 10  # torchvision's RandomResizedCrop.get_params: draws before its centre-crop fallback


def rrc_boxes(sizes, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), generator: torch.Generator | None = None,
              attempts: int = ATTEMPTS) -> torch.Tensor:
    """torchvision's `RandomResizedCrop.get_params` for a batch: int64 [B, 4] rows (top, left,
    height, width) in each sample's own pixels, `sizes` int [B, 2] rows (h, w).

    Up to `attempts` draws per sample of an area fraction uniform in `scale` and an aspect
    ratio log-uniform in `ratio`, rounded to whole pixels (half to even, as Python's round);
    the first that fits is placed uniformly; none fits: the largest centre crop whose aspect
    is clamped into `ratio`. The draws come from `generator` (on its device), all at once."""
    _check_rrc(scale, ratio)
    sizes = torch.as_tensor(sizes)
    hw = sizes.cpu().numpy()
    if hw.ndim != 2 or hw.shape[1] != 2 or bool((hw <= 0).any()):
        raise ValueError(f"rrc_boxes: sizes must be [B, 2] rows of positive (h, w), got shape {tuple(sizes.shape)}")
    [draw] = _draws(generator, ((len(hw), attempts, 4), torch.float64))
    return torch.from_numpy(_rrc(hw, draw, scale, ratio)).to(sizes.device)


def _check_rrc(scale, ratio) -> None:
    if not (0 < scale[0] <= scale[1]) or not (0 < ratio[0] <= ratio[1]):
        raise ValueError(f"rrc_boxes: scale {tuple(scale)} and ratio {tuple(ratio)} must be positive (low, high) pairs")


def _draws(generator: torch.Generator | None, *wanted) -> list[np.ndarray]:
    """`torch.rand` of each (shape, dtype) in turn, from `generator`'s stream of numbers on its
    device, as numpy arrays on the host: a CUDA generator's come back in one copy (the boxes and
    taps are worked out on the host)."""
    if any(dtype not in _NUMPY for _, dtype in wanted):
        raise ValueError(f"random draws in {[str(d) for _, d in wanted]}: torch's default dtype must be float16, 32 or 64")
    dev = generator.device if generator is not None else torch.device("cpu")
    if dev.type == "cpu":
        return [torch.rand(shape, generator=generator, dtype=dtype).numpy() for shape, dtype in wanted]
    parts, at = [], 0
    for shape, dtype in wanted:  # each at an 8-byte boundary of one buffer
        parts.append((at, math.prod(shape)))
        at += -(-math.prod(shape) * dtype.itemsize // 8) * 8
    both = torch.empty(at, dtype=torch.uint8, device=dev)
    for (shape, dtype), (start, count) in zip(wanted, parts):
        torch.rand(shape, generator=generator, out=both[start:].view(dtype)[:count].view(shape))
    host = both.cpu().numpy()
    return [host[start:].view(_NUMPY[dtype])[:count].reshape(shape) for (shape, dtype), (start, count) in zip(wanted, parts)]


_NUMPY = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16}


def _rrc(hw: np.ndarray, draw: np.ndarray, scale, ratio) -> np.ndarray:
    """`rrc_boxes`' arithmetic in float64 on the host, a fixed number of vectorised steps:
    sizes [B, 2] and draws [B, attempts, 4] uniform in [0, 1) -> int64 [B, 4] boxes."""
    hw = hw.astype(np.float64)
    H, W = hw[:, 0:1], hw[:, 1:2]
    area = H * W * (scale[0] + (scale[1] - scale[0]) * draw[..., 0])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = np.exp(lo + (hi - lo) * draw[..., 1])
    w = np.round(np.sqrt(area * aspect))  # half to even, as Python's round
    h = np.round(np.sqrt(area / aspect))
    fits = (w > 0) & (w <= W) & (h > 0) & (h <= H)
    first = fits.argmax(1)[:, None]  # the first draw that fits
    h, w = np.take_along_axis(h, first, 1), np.take_along_axis(w, first, 1)
    top = np.minimum(np.floor(np.take_along_axis(draw[..., 2], first, 1) * (H - h + 1)), H - h)
    left = np.minimum(np.floor(np.take_along_axis(draw[..., 3], first, 1) * (W - w + 1)), W - w)
    # the fallback: the whole image, its aspect clamped into `ratio`, centred
    in_ratio = W / H
    fw = np.where(in_ratio > ratio[1], np.round(H * ratio[1]), W)
    fh = np.where(in_ratio < ratio[0], np.round(W / ratio[0]), H)
    missed = ~fits.any(1, keepdims=True)
    h, w = np.where(missed, fh, h), np.where(missed, fw, w)
    top = np.where(missed, np.floor((H - h) / 2), top)
    left = np.where(missed, np.floor((W - w) / 2), left)
    return np.concatenate([top, left, h, w], 1).astype(np.int64)


def train_transform(images: torch.Tensor, sizes=None, size: int = 224, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                    flip: float = 0.5, generator: torch.Generator | None = None, dtype=torch.float32,
                    mean=IMAGENET_MEAN, std=IMAGENET_STD, channels_last: bool = False, boxes=None,
                    flips=None) -> torch.Tensor:
    """uint8 canvas [B, H, W, 3] (+ `sizes` int [B, 2], default: every sample fills it; a
    batch that looks like a padded canvas is then refused) ->
    `dtype` [B, 3, size, size]: a random resized crop of each sample (`rrc_boxes`, or the given
    `boxes`), flipped left-right with probability `flip` (or where bool [B] `flips` is true),
    normalised as (x / 255 - mean) / std. `channels_last`: the result in that memory format."""
    sizes = _sizes(images, sizes)
    if boxes is None and flips is None:  # both draws in the order rrc_boxes and then the flips take them
        _check_rrc(scale, ratio)
        draw, u = _draws(generator, ((len(sizes), ATTEMPTS, 4), torch.float64), ((len(sizes),), torch.get_default_dtype()))
        boxes, flips = _rrc(sizes, draw, scale, ratio), u < u.dtype.type(flip)  # flip in the draws' dtype, as torch compares
    elif boxes is None:
        boxes = rrc_boxes(sizes, scale, ratio, generator)
    elif flips is None:
        [u] = _draws(generator, ((len(sizes),), torch.get_default_dtype()))
        flips = u < u.dtype.type(flip)
    boxes = _check_boxes(boxes, sizes)
    flips = _host(flips).astype(bool)
    rows, cols = _box_spans(boxes, size)
    return _transform(images, rows, cols, size, flips, dtype, mean, std, channels_last)


def move_boxes(targets: torch.Tensor, crops, flips, size: int, lengths=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Detection boxes moved as `train_transform` moves the pixels under them: float [B, N, 4]
    (x1, y1, x2, y2) in each sample's own pixels, its `crops` int [B, 4] (top, left, height,
    width) resized to size x size and `flips` bool [B] -> the boxes in the output's pixels,
    clipped to it, and bool [B, N] `keep`: a box that still has area in the crop (and, with
    `lengths` int [B], is one of the sample's, not padding). All on `targets`' device, batched."""
    crops = torch.as_tensor(crops).to(targets.device, targets.dtype)
    top, left, h, w = crops.unbind(1)
    scale = torch.stack([size / w, size / h, size / w, size / h], 1)[:, None, :]
    moved = (targets - torch.stack([left, top, left, top], 1)[:, None, :]) * scale
    moved = moved.clamp(0, size)
    flips = torch.as_tensor(flips, dtype=torch.bool).to(targets.device)[:, None]
    x1, y1, x2, y2 = moved.unbind(2)
    moved = torch.stack([torch.where(flips, size - x2, x1), y1, torch.where(flips, size - x1, x2), y2], 2)
    keep = (moved[..., 2] > moved[..., 0]) & (moved[..., 3] > moved[..., 1])
    if lengths is not None:
        lengths = torch.as_tensor(lengths).to(targets.device)
        keep &= torch.arange(targets.shape[1], device=targets.device)[None, :] < lengths[:, None]
    return moved, keep


def detection_transform(images: torch.Tensor, sizes, boxes: torch.Tensor, lengths=None, size: int = 512,
                        scale=(0.3, 1.0), ratio=(3 / 4, 4 / 3), flip: float = 0.5,
                        generator: torch.Generator | None = None, dtype=torch.float32, mean=IMAGENET_MEAN,
                        std=IMAGENET_STD) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`train_transform` of a detection batch (a keep-aspect canvas and `image_size`, `boxes`
    [B, N, 4] and `boxes_lengths` as Loader gives a COCO build) with its boxes moved with the
    pixels (`move_boxes`): (images [B, 3, size, size], boxes [B, N, 4] in the output's pixels,
    keep bool [B, N])."""
    sizes = _sizes(images, sizes)
    crops = rrc_boxes(sizes, scale, ratio, generator)
    dev = generator.device if generator is not None else torch.device("cpu")
    flips = torch.rand(len(sizes), generator=generator, device=dev) < flip
    x = train_transform(images, sizes, size, boxes=crops, flips=flips, dtype=dtype, mean=mean, std=std)
    moved, keep = move_boxes(boxes.to(torch.float32), crops, flips, size, lengths)
    return x, moved, keep


def eval_transform(images: torch.Tensor, sizes=None, size: int = 224, resize: int = 256, dtype=torch.float32,
                   mean=IMAGENET_MEAN, std=IMAGENET_STD, channels_last: bool = False) -> torch.Tensor:
    """uint8 canvas [B, H, W, 3] (+ `sizes`) -> `dtype` [B, 3, size, size]: torchvision's
    `Resize(resize)` (shorter side to `resize`, the longer one int(resize * long / short),
    antialiased bilinear) then `CenterCrop(size)` (offsets int(round(excess / 2))), normalised."""
    if resize < size:
        raise ValueError(f"eval_transform: resize {resize} is smaller than the crop size {size}")
    h, w = _sizes(images, sizes).astype(np.float64).T
    # packer.dataset.geometry.keep_aspect_size's rule, for the batch at once
    rh = np.where(h <= w, float(resize), np.floor(resize * h / w))
    rw = np.where(h <= w, np.floor(resize * w / h), float(resize))
    zero = np.zeros_like(h)
    rows = (zero, h, rh, np.round((rh - size) / 2))
    cols = (zero, w, rw, np.round((rw - size) / 2))
    return _transform(images, rows, cols, size, None, dtype, mean, std, channels_last)


def normalize(images: torch.Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD, dtype=torch.float32) -> torch.Tensor:
    """uint8 [B, H, W, C] -> `dtype` [B, C, H, W], (x / 255 - mean) / std, no resampling."""
    x = images.permute(0, 3, 1, 2).to(dtype).div_(255)
    m = torch.tensor(mean, dtype=dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=dtype, device=x.device).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)


def random_flip(x: torch.Tensor, p: float = 0.5, generator: torch.Generator | None = None) -> torch.Tensor:
    """Flip each [C, H, W] sample left-right with probability p (`train_transform` folds this
    into its resampling; this is for batches already transformed some other way)."""
    flip = torch.rand(x.shape[0], generator=generator, device=generator.device if generator else "cpu") < p
    flip = flip.to(x.device).view(-1, 1, 1, 1)
    return torch.where(flip, x.flip(-1), x)


def random_resized_crop(x: torch.Tensor, size: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                        generator: torch.Generator | None = None, sizes=None) -> torch.Tensor:
    """[B, C, H, W] float -> [B, C, size, size]: `train_transform`'s crop and resize (no flip,
    no normalisation) of a batch that is already float (`sizes` as there)."""
    hwc = x.permute(0, 2, 3, 1)
    C = hwc.shape[3]
    rows, cols = _box_spans(rrc_boxes(_sizes(hwc, sizes), scale, ratio, generator), size)
    return _transform(hwc, rows, cols, size, None, x.dtype, (0.0,) * C, (1 / 255,) * C, False)


# -- the resampling --------------------------------------------------------------------------
# Sizes, boxes, flips and the interpolation taps (a few numbers a sample) are checked and worked
# out on the host, in numpy, in a fixed number of vectorised steps whatever the batch size, and
# reach the device in one copy that is not waited for. Built there, from a hundred small tensor
# ops, they cost a kernel launch each (136 a call on an H100); and a value read back from the
# device waits for everything queued before it, after which the host's launches no longer
# overlap the GPU's work (seen on an H200: 7 such waits a call, 3.7 ms a batch for 1.5 ms of
# kernels).
def _host(values) -> np.ndarray:
    """A tensor (on any device), array or list as a numpy array on the host."""
    return values.cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)


def _sizes(images: torch.Tensor, sizes) -> np.ndarray:
    """The batch's (h, w) rows as int64 [B, 2] on the host, checked against the canvas."""
    if images.dim() != 4:
        raise ValueError(f"expected a uint8 canvas [B, H, W, C], got shape {tuple(images.shape)}")
    B, H, W, _ = images.shape
    if sizes is None:
        _refuse_a_padded_canvas(images)
        return np.tile(np.array([H, W], np.int64), (B, 1))
    sizes = _host(sizes).astype(np.int64)  # one read back, if on the device, not three
    if sizes.shape != (B, 2):
        raise ValueError(f"sizes: expected [{B}, 2] (h, w) rows, got shape {tuple(sizes.shape)}")
    if B and (bool((sizes <= 0).any()) or int(sizes[:, 0].max()) > H or int(sizes[:, 1].max()) > W):
        raise ValueError(f"sizes: every (h, w) must be positive and fit the canvas {H} x {W}")
    return sizes


def _refuse_a_padded_canvas(images: torch.Tensor) -> None:
    """Without sizes, every sample is taken to fill the canvas. A keep-aspect (or 'keep') batch
    does not: each sample narrower or shorter than the batch's largest ends in zeroed columns or
    rows below or right of its pixels, which a crop would then take for the image, silently. A
    sample looks padded when its last row (column) is all zero while its first is not: a
    canvas pads only below and right, where a black background or a letterbox is black on both
    sides. A batch in which half of the samples or more (two at least) look padded is refused:
    in a canvas of mixed shapes nearly all do; of the 90 test photo crops at a fixed size, 2
    end in a black row (a dark scene), and half a batch of such never comes together. For
    images that really end in black, pass their full sizes."""
    B, H, W, _ = images.shape
    if not B or H == 0 or W == 0:
        return
    # the largest value of the first and last rows and columns (strided views reduced into one
    # buffer, read back in one copy): an edge is all zero where its largest value is
    rows, cols = images[:, ::max(H - 1, 1)], images[:, :, ::max(W - 1, 1)]
    if images.dtype.is_floating_point or images.dtype.is_signed:  # all zero: no value away from 0
        rows, cols = rows.abs(), cols.abs()
    r = rows.shape[1]
    peaks = torch.empty(B * (r + cols.shape[2]), dtype=images.dtype, device=images.device)
    torch.amax(rows, (2, 3), out=peaks[:B * r].view(B, r))
    torch.amax(cols, (1, 3), out=peaks[B * r:].view(B, -1))
    black = _host(peaks) == 0
    by_row, by_col = black[:B * r].reshape(B, r), black[B * r:].reshape(B, -1)
    padded = int(((by_row[:, -1] & ~by_row[:, 0]) | (by_col[:, -1] & ~by_col[:, 0])).sum())
    if padded >= max(2, (B + 1) // 2):
        raise ValueError(f"{padded} of {B} samples end in all-zero rows or columns, as in a keep-aspect batch's "
                         "canvas: pass sizes=batch['image_size'] (Loader gives it with the canvas); for images "
                         f"that really fill it, pass sizes=torch.tensor([[{H}, {W}]]).expand({B}, 2)")


def _check_boxes(boxes, sizes: np.ndarray) -> np.ndarray:
    """Boxes (top, left, height, width) that lie inside their sample's (h, w): never the padding."""
    b = _host(boxes)
    if b.shape != (len(sizes), 4):
        raise ValueError(f"boxes: expected [{len(sizes)}, 4] (top, left, height, width) rows, got {tuple(b.shape)}")
    b = b.astype(np.int64)
    if bool(((b[:, :2] < 0) | (b[:, 2:] <= 0) | (b[:, :2] + b[:, 2:] > sizes)).any()):
        raise ValueError("boxes: every box must have a positive size and lie inside its sample's own (h, w)")
    return b


def _box_spans(boxes, size: int):
    """Crop boxes (top, left, height, width) as the spans of `_transform`: each box resized to size x size."""
    top, left, h, w = _host(boxes).astype(np.float64).T
    n, zero = np.full_like(h, float(size)), np.zeros_like(h)
    return (top, h, n, zero), (left, w, n, zero)


def _taps(start, length, resized, offset, n: int, flip=None):
    """The taps of torch's antialiased bilinear `interpolate` (align_corners=False) along one axis,
    per sample, in float64 on the host: output i of `n` is pixel i + offset of the input segment
    [start, start + length) resized to `resized` pixels. Returns (index int64 [B, n, K] into the
    axis, weight float64 [B, n, K]); unused taps have weight 0 and a valid index. `flip` (bool
    [B]): outputs reversed."""
    scale = length / resized
    support = np.maximum(scale, 1.0)  # the filter widens with the shrink factor: the antialiasing
    i = np.arange(n, dtype=np.float64)
    center = scale[:, None] * (i[None] + offset[:, None] + 0.5)
    first = np.maximum(np.trunc(center - support[:, None] + 0.5), 0)
    stop = np.minimum(np.trunc(center + support[:, None] + 0.5), length[:, None])
    K = max(1, int((stop - first).max()))
    j = first[..., None] + np.arange(K, dtype=np.float64)
    weight = np.maximum(1 - np.abs((j - center[..., None] + 0.5) / support[:, None, None]), 0)
    weight = weight * (j < stop[..., None])
    weight = weight / weight.sum(-1, keepdims=True)
    index = (start[:, None, None] + np.minimum(j, length[:, None, None] - 1)).astype(np.int64)
    if flip is not None:
        f = np.asarray(flip, bool).reshape(-1, 1, 1)
        index, weight = np.where(f, index[:, ::-1], index), np.where(f, weight[:, ::-1], weight)
    return index, weight


def _transform(x: torch.Tensor, rows, cols, n: int, flips, dtype, mean, std, channels_last: bool) -> torch.Tensor:
    """[B, H, W, C] and, per axis, (start, length, resized, offset) float64 [B] on the host ->
    `dtype` [B, C, n, n]: each sample's segment [start, start + length) of the axis resized to
    `resized` pixels, then pixels [offset, offset + n) of it, reversed left-right where `flips`
    (bool [B]), normalised as (y / 255 - mean) / std."""
    B, C = x.shape[0], x.shape[3]
    scale, shift = _affine(tuple(map(float, mean)), tuple(map(float, std)), C, x.device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty(B, C, n, n, dtype=torch.float32, device=x.device, memory_format=fmt)
    if B and _dense_path(x):
        torch.addcmul(shift, _dense(x, rows, cols, n, flips), scale, out=out)
    elif B:  # torch's own antialiased interpolate per sample (it has a fast uint8 kernel), normalised in cache
        spans = np.stack([*rows, *cols], 1).astype(np.int64).tolist()
        flips = [False] * B if flips is None else flips.tolist()
        for b, (ys, yl, yr, yo, xs, xl, xr, xo) in enumerate(spans):
            crop = x[b, ys:ys + yl, xs:xs + xl].permute(2, 0, 1)[None]
            y = F.interpolate(crop, size=(yr, xr), mode="bilinear", antialias=True, align_corners=False)
            y = y[0, :, yo:yo + n, xo:xo + n]
            torch.addcmul(shift, y.flip(2) if flips[b] else y, scale, out=out[b])
    return out if dtype == torch.float32 else out.to(dtype, memory_format=fmt)


@functools.lru_cache(maxsize=16)
def _affine(mean: tuple, std: tuple, channels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) [C, 1, 1] on `device`, so that y * scale + shift = (y / 255 - mean) / std:
    made once per device, not copied there at every call."""
    std_ = torch.tensor(std, dtype=torch.float32).view(channels, 1, 1)
    scale, shift = 1 / (255 * std_), -torch.tensor(mean, dtype=torch.float32).view(channels, 1, 1) / std_
    return scale.to(device), shift.to(device)


def _dense_path(x: torch.Tensor) -> bool:
    """The batched matrix products where kernel launches cost more than arithmetic (CUDA)."""
    return x.is_cuda


def _dense(x: torch.Tensor, rows, cols, n: int, flips) -> torch.Tensor:
    """Both axes as batched matrix products in float16, in a fixed number of kernels whatever the
    batch size: [B, H, W, C] -> float16 [B, C, n (row i), n (column j)].

    The taps of every sample go to the device in one copy and are scattered into one buffer
    holding the rows' [B, n, Hr] and the columns' [B, n, Wc] matrices, Hr x Wc the part of the
    canvas the taps read (only that part is cast); the rows' product, moved to put the columns
    first, is the columns' product's right-hand side."""
    B = x.shape[0]
    taps = _taps(*rows, n), _taps(*cols, n, flip=flips)
    # as torch casts a double to float16 (through float32); a zero weight adds nothing, so it is no entry
    (ri, rw), (ci, cw) = ((index, weight.astype(np.float32).astype(np.float16)) for index, weight in taps)
    rk, ck = rw != 0, cw != 0
    # what the crops read: rows and columns up to the furthest a tap reaches. Trimming the near
    # side too would regroup the products' sums (their blocks start at the canvas' corner), and
    # the float16 results would no longer be the same bits as the whole canvas'.
    Hr, Wc = int(ri[rk].max()) + 1, int(ci[ck].max()) + 1
    out = np.arange(B * n, dtype=np.int64).reshape(B, n, 1)
    # a sample's taps never meet at one input pixel with a weight each: no entry is written twice
    places = np.concatenate([(out * Hr + ri)[rk], B * n * Hr + (out * Wc + ci)[ck]])
    places, weights = _to_device(places, np.concatenate([rw[rk], cw[ck]]), x.device)
    m = torch.zeros(B * n * (Hr + Wc), dtype=torch.float16, device=x.device).scatter_(0, places, weights)
    m_rows, m_cols = m[:B * n * Hr].view(B, n, Hr), m[B * n * Hr:].view(B, n, Wc)
    C = x.shape[3]
    part = x[:, :Hr, :Wc].to(torch.float16).reshape(B, Hr, -1)
    t = torch.bmm(m_rows, part).view(B, n, Wc, C).transpose(1, 2).reshape(B, Wc, n * C)
    return torch.bmm(m_cols, t).view(B, n, n, C).permute(0, 3, 2, 1)


def _to_device(places: np.ndarray, weights: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 places and float16 weights on `device` in one copy from pinned memory, not waited for."""
    data = np.empty(places.nbytes + weights.nbytes, np.uint8)
    data[:places.nbytes], data[places.nbytes:] = places.view(np.uint8), weights.view(np.uint8)
    both = torch.from_numpy(data)
    if device.type != "cpu":
        both = both.pin_memory().to(device, non_blocking=True)
    return both[:places.nbytes].view(torch.int64), both[places.nbytes:].view(torch.float16)
