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
float16 and the result is within 0.1 of a level; the flip is the horizontal taps reversed): a
per-sample loop would be 2 x B kernel launches. Elsewhere it is torch's own interpolate per
sample, whose uint8 kernel beats any batched float formulation on a CPU (docs/design.md).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from packer.dataset.geometry import keep_aspect_size

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def rrc_boxes(sizes, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), generator: torch.Generator | None = None,
              attempts: int = 10) -> torch.Tensor:
    """torchvision's `RandomResizedCrop.get_params` for a batch: int64 [B, 4] rows (top, left,
    height, width) in each sample's own pixels, `sizes` int [B, 2] rows (h, w).

    Up to `attempts` draws per sample of an area fraction uniform in `scale` and an aspect
    ratio log-uniform in `ratio`, rounded to whole pixels (half to even, as Python's round);
    the first that fits is placed uniformly; none fits: the largest centre crop whose aspect
    is clamped into `ratio`. The draws come from `generator` (on its device), all at once."""
    if not (0 < scale[0] <= scale[1]) or not (0 < ratio[0] <= ratio[1]):
        raise ValueError(f"rrc_boxes: scale {tuple(scale)} and ratio {tuple(ratio)} must be positive (low, high) pairs")
    sizes = torch.as_tensor(sizes)
    if sizes.dim() != 2 or sizes.shape[1] != 2 or bool((sizes <= 0).any()):
        raise ValueError(f"rrc_boxes: sizes must be [B, 2] rows of positive (h, w), got shape {tuple(sizes.shape)}")
    dev = generator.device if generator is not None else torch.device("cpu")
    # from the host, not waiting for the device's queue; a copy back to the host must complete
    # before its values are read, so that one blocks
    hw = sizes.to(dev, torch.float64, non_blocking=sizes.device.type == "cpu")
    H, W = hw[:, 0:1], hw[:, 1:2]
    B = len(sizes)
    draw = torch.rand(B, attempts, 4, generator=generator, device=dev, dtype=torch.float64)
    area = H * W * (scale[0] + (scale[1] - scale[0]) * draw[..., 0])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(lo + (hi - lo) * draw[..., 1])
    w = torch.round(torch.sqrt(area * aspect))
    h = torch.round(torch.sqrt(area / aspect))
    fits = (w > 0) & (w <= W) & (h > 0) & (h <= H)
    first = fits.to(torch.int8).argmax(1, keepdim=True)  # the first draw that fits
    h, w = h.gather(1, first), w.gather(1, first)
    top = torch.floor(draw[..., 2].gather(1, first) * (H - h + 1)).clamp(max=H - h)
    left = torch.floor(draw[..., 3].gather(1, first) * (W - w + 1)).clamp(max=W - w)
    # the fallback: the whole image, its aspect clamped into `ratio`, centred
    in_ratio = W / H
    fw = torch.where(in_ratio > ratio[1], torch.round(H * ratio[1]), W)
    fh = torch.where(in_ratio < ratio[0], torch.round(W / ratio[0]), H)
    missed = ~fits.any(1, keepdim=True)
    h, w = torch.where(missed, fh, h), torch.where(missed, fw, w)
    top = torch.where(missed, torch.div(H - h, 2, rounding_mode="floor"), top)
    left = torch.where(missed, torch.div(W - w, 2, rounding_mode="floor"), left)
    return torch.cat([top, left, h, w], 1).to(torch.int64).to(sizes.device)


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
    if boxes is None:
        boxes = rrc_boxes(sizes, scale, ratio, generator)
    if flips is None:
        dev = generator.device if generator is not None else torch.device("cpu")
        flips = torch.rand(len(sizes), generator=generator, device=dev) < flip
    boxes = _check_boxes(torch.as_tensor(boxes), sizes)
    flips = torch.as_tensor(flips, dtype=torch.bool).to(images.device)
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
    sizes = _sizes(images, sizes)
    resized = torch.tensor([keep_aspect_size(w, h, resize)[::-1] for h, w in sizes.tolist()], dtype=torch.float64)
    h, w = sizes.to(torch.float64).unbind(1)
    rh, rw = resized.unbind(1)
    zero = torch.zeros_like(h)
    rows = (zero, h, rh, torch.round((rh - size) / 2))
    cols = (zero, w, rw, torch.round((rw - size) / 2))
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
# Sizes, boxes and spans (a few numbers a sample) are checked and kept on the host, and reach the
# device once, without a wait: a value read back from the device (a check, a width) waits for
# everything queued before it, and the host's kernel launches then no longer overlap the GPU's
# work (seen on an H200: 7 such waits a call, 3.7 ms a batch for 1.5 ms of kernels).
def _sizes(images: torch.Tensor, sizes) -> torch.Tensor:
    if images.dim() != 4:
        raise ValueError(f"expected a uint8 canvas [B, H, W, C], got shape {tuple(images.shape)}")
    B, H, W, _ = images.shape
    if sizes is None:
        _refuse_a_padded_canvas(images)
        return torch.tensor([[H, W]] * B, dtype=torch.int64)
    sizes = torch.as_tensor(sizes).to("cpu", torch.int64)  # one read back, if on the device, not three
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

    def black(edge: torch.Tensor) -> torch.Tensor:
        return (edge == 0).flatten(1).all(1)

    padded = int(((black(images[:, -1]) & ~black(images[:, 0])) |
                  (black(images[:, :, -1]) & ~black(images[:, :, 0]))).sum())
    if padded >= max(2, (B + 1) // 2):
        raise ValueError(f"{padded} of {B} samples end in all-zero rows or columns, as in a keep-aspect batch's "
                         "canvas: pass sizes=batch['image_size'] (Loader gives it with the canvas); for images "
                         f"that really fill it, pass sizes=torch.tensor([[{H}, {W}]]).expand({B}, 2)")


def _check_boxes(boxes: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Boxes (top, left, height, width) that lie inside their sample's (h, w): never the padding."""
    if boxes.shape != (len(sizes), 4):
        raise ValueError(f"boxes: expected [{len(sizes)}, 4] (top, left, height, width) rows, got {tuple(boxes.shape)}")
    b, s = boxes.cpu().to(torch.int64), sizes.cpu()
    if bool(((b[:, :2] < 0) | (b[:, 2:] <= 0) | (b[:, :2] + b[:, 2:] > s)).any()):
        raise ValueError("boxes: every box must have a positive size and lie inside its sample's own (h, w)")
    return b


def _box_spans(boxes: torch.Tensor, size: int):
    """Crop boxes (top, left, height, width) as the spans of `_transform`: each box resized to size x size."""
    top, left, h, w = boxes.to(torch.float64).unbind(1)
    n, zero = torch.full_like(h, float(size)), torch.zeros_like(h)
    return (top, h, n, zero), (left, w, n, zero)


def _tap_width(span, n: int) -> int:
    """A bound, known on the host, of `_taps`' width (taps per output pixel): no more than twice
    the filter's support of the most shrunk sample, rounded up, and one. A sample's taps past its
    own have weight 0 and a valid index, so the result is the same as with the exact width."""
    _, length, resized, _ = span
    if not len(length):
        return 1
    return math.ceil(2 * max(1.0, float((length / resized).max()))) + 1


def _taps(start, length, resized, offset, n: int, flip=None, width: int | None = None):
    """The taps of torch's antialiased bilinear `interpolate` (align_corners=False) along one axis,
    per sample: output i of `n` is pixel i + offset of the input segment [start, start + length)
    resized to `resized` pixels. Returns (index int64 [B, n, K] into the axis, weight float64
    [B, n, K]); unused taps have weight 0 and a valid index. `flip` (bool [B]): outputs reversed."""
    scale = length / resized
    support = scale.clamp(min=1.0)  # the filter widens with the shrink factor: the antialiasing
    i = torch.arange(n, dtype=torch.float64, device=scale.device)
    center = scale[:, None] * (i[None] + offset[:, None] + 0.5)
    first = torch.trunc(center - support[:, None] + 0.5).clamp(min=0)
    stop = torch.minimum(torch.trunc(center + support[:, None] + 0.5), length[:, None])
    K = width if width is not None else max(1, int((stop - first).max())) if len(scale) else 1
    j = first[..., None] + torch.arange(K, dtype=torch.float64, device=scale.device)
    weight = (1 - ((j - center[..., None] + 0.5) / support[:, None, None]).abs()).clamp(min=0)
    weight = weight * (j < stop[..., None])
    weight = weight / weight.sum(-1, keepdim=True)
    index = (start[:, None, None] + torch.minimum(j, length[:, None, None] - 1)).to(torch.int64)
    if flip is not None:
        f = flip.view(-1, 1, 1).to(torch.bool)
        index, weight = torch.where(f, index.flip(1), index), torch.where(f, weight.flip(1), weight)
    return index, weight


def _transform(x: torch.Tensor, rows, cols, n: int, flips, dtype, mean, std, channels_last: bool) -> torch.Tensor:
    """[B, H, W, C] and, per axis, (start, length, resized, offset) float64 [B] -> `dtype`
    [B, C, n, n]: each sample's segment [start, start + length) of the axis resized to `resized`
    pixels, then pixels [offset, offset + n) of it, reversed left-right where `flips` (bool [B]),
    normalised as (y / 255 - mean) / std."""
    B, C = x.shape[0], x.shape[3]
    scale, shift = _affine(tuple(map(float, mean)), tuple(map(float, std)), C, x.device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty(B, C, n, n, dtype=torch.float32, device=x.device, memory_format=fmt)
    if _dense_path(x):
        widths = _tap_width(rows, n), _tap_width(cols, n)
        rows, cols = ([t.to(x.device, non_blocking=t.device.type == "cpu") for t in span] for span in (rows, cols))
        y = _dense(_dense(x, 1, *_taps(*rows, n, width=widths[0])), 2, *_taps(*cols, n, flip=flips, width=widths[1]))
        torch.addcmul(shift, y.permute(0, 3, 1, 2), scale, out=out)
    else:  # torch's own antialiased interpolate per sample (it has a fast uint8 kernel), normalised in cache
        spans = torch.stack([*rows, *cols], 1).to(torch.int64).tolist()
        flips = [False] * B if flips is None else torch.as_tensor(flips).tolist()
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


def _dense(x: torch.Tensor, dim: int, index, weight) -> torch.Tensor:
    """One axis as a batched matrix product in float16: the taps scattered into a [B, n, L]
    matrix (L the axis' length), times the batch with that axis in front."""
    B, n, _ = index.shape
    L = x.shape[dim]
    m = torch.zeros(B, n, L, dtype=torch.float16, device=x.device).scatter_add_(2, index, weight.to(torch.float16))
    moved = x.movedim(dim, 1)  # [B, L, rest...]
    rest = moved.shape[2:]
    y = torch.bmm(m, moved.reshape(B, L, -1).to(torch.float16))
    return y.view(B, n, *rest).movedim(1, dim)
