"""The transform as it was before its boxes and taps moved to the host (loaders/augment.py at
c5fbfde): the boxes, the taps and both matrices built with torch ops on the batch's device, over
the whole canvas. The tests hold the new path to these bits."""

from __future__ import annotations

import math

import torch

from loaders.augment import IMAGENET_MEAN, IMAGENET_STD


def rrc_boxes(sizes: torch.Tensor, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), generator=None, attempts: int = 10):
    dev = generator.device if generator is not None else torch.device("cpu")
    hw = sizes.to(dev, torch.float64)
    H, W = hw[:, 0:1], hw[:, 1:2]
    draw = torch.rand(len(sizes), attempts, 4, generator=generator, device=dev, dtype=torch.float64)
    area = H * W * (scale[0] + (scale[1] - scale[0]) * draw[..., 0])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(lo + (hi - lo) * draw[..., 1])
    w, h = torch.round(torch.sqrt(area * aspect)), torch.round(torch.sqrt(area / aspect))
    fits = (w > 0) & (w <= W) & (h > 0) & (h <= H)
    first = fits.to(torch.int8).argmax(1, keepdim=True)
    h, w = h.gather(1, first), w.gather(1, first)
    top = torch.floor(draw[..., 2].gather(1, first) * (H - h + 1)).clamp(max=H - h)
    left = torch.floor(draw[..., 3].gather(1, first) * (W - w + 1)).clamp(max=W - w)
    in_ratio = W / H
    fw = torch.where(in_ratio > ratio[1], torch.round(H * ratio[1]), W)
    fh = torch.where(in_ratio < ratio[0], torch.round(W / ratio[0]), H)
    missed = ~fits.any(1, keepdim=True)
    h, w = torch.where(missed, fh, h), torch.where(missed, fw, w)
    top = torch.where(missed, torch.div(H - h, 2, rounding_mode="floor"), top)
    left = torch.where(missed, torch.div(W - w, 2, rounding_mode="floor"), left)
    return torch.cat([top, left, h, w], 1).to(torch.int64).cpu()


def _taps(start, length, resized, offset, n: int, flip=None):
    scale = length / resized
    support = scale.clamp(min=1.0)
    i = torch.arange(n, dtype=torch.float64, device=scale.device)
    center = scale[:, None] * (i[None] + offset[:, None] + 0.5)
    first = torch.trunc(center - support[:, None] + 0.5).clamp(min=0)
    stop = torch.minimum(torch.trunc(center + support[:, None] + 0.5), length[:, None])
    j = first[..., None] + torch.arange(max(1, int((stop - first).max())), dtype=torch.float64, device=scale.device)
    weight = (1 - ((j - center[..., None] + 0.5) / support[:, None, None]).abs()).clamp(min=0)
    weight = weight * (j < stop[..., None])
    weight = weight / weight.sum(-1, keepdim=True)
    index = (start[:, None, None] + torch.minimum(j, length[:, None, None] - 1)).to(torch.int64)
    if flip is not None:
        f = flip.to(scale.device).view(-1, 1, 1)
        index, weight = torch.where(f, index.flip(1), index), torch.where(f, weight.flip(1), weight)
    return index, weight


def _dense(x: torch.Tensor, dim: int, index, weight) -> torch.Tensor:
    B, n, _ = index.shape
    L = x.shape[dim]
    m = torch.zeros(B, n, L, dtype=torch.float16, device=x.device).scatter_add_(2, index, weight.to(torch.float16))
    moved = x.movedim(dim, 1)
    y = torch.bmm(m, moved.reshape(B, L, -1).to(torch.float16))
    return y.view(B, n, *moved.shape[2:]).movedim(1, dim)


def transform(x: torch.Tensor, rows, cols, n: int, flips=None, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:
    """float32 [B, C, n, n] from a uint8 [B, H, W, C] canvas and per-axis (start, length, resized,
    offset) float64 tensors, as the batched path computed it, on the canvas' device."""
    C = x.shape[3]
    std_ = torch.tensor(std, dtype=torch.float32).view(C, 1, 1)
    scale, shift = 1 / (255 * std_), -torch.tensor(mean, dtype=torch.float32).view(C, 1, 1) / std_
    scale, shift = scale.to(x.device), shift.to(x.device)
    rows, cols = ([t.to(x.device) for t in span] for span in (rows, cols))
    y = _dense(_dense(x, 1, *_taps(*rows, n)), 2, *_taps(*cols, n, flip=flips))
    return torch.addcmul(shift, y.permute(0, 3, 1, 2), scale)


def train(x: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor, n: int) -> torch.Tensor:
    top, left, h, w = boxes.to(torch.float64).unbind(1)
    size, zero = torch.full_like(h, float(n)), torch.zeros_like(h)
    return transform(x, (top, h, size, zero), (left, w, size, zero), n, flips)


def evaluate(x: torch.Tensor, sizes: torch.Tensor, n: int, resize: int) -> torch.Tensor:
    h, w = sizes.to(torch.float64).unbind(1)
    rh = torch.tensor([resize if a <= b else int(resize * a / b) for a, b in sizes.tolist()], dtype=torch.float64)
    rw = torch.tensor([int(resize * b / a) if a <= b else resize for a, b in sizes.tolist()], dtype=torch.float64)
    zero = torch.zeros_like(h)
    return transform(x, (zero, h, rh, torch.round((rh - n) / 2)), (zero, w, rw, torch.round((rw - n) / 2)), n)
