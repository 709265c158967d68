"""Whole-batch augmentation on the device the batch is on, so the CPU does none: uint8 HWC ->
normalised float CHW, random horizontal flip, and random-resized-crop through one batched
`affine_grid` + `grid_sample` (bilinear), one random draw per sample from a torch Generator.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def normalize(images: torch.Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD, dtype=torch.float32) -> torch.Tensor:
    """uint8 [B, H, W, C] -> `dtype` [B, C, H, W], (x / 255 - mean) / std."""
    x = images.permute(0, 3, 1, 2).to(dtype).div_(255)
    m = torch.tensor(mean, dtype=dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=dtype, device=x.device).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)


def random_flip(x: torch.Tensor, p: float = 0.5, generator: torch.Generator | None = None) -> torch.Tensor:
    """Flip each [C, H, W] sample left-right with probability p."""
    flip = torch.rand(x.shape[0], generator=generator, device=generator.device if generator else "cpu") < p
    flip = flip.to(x.device).view(-1, 1, 1, 1)
    return torch.where(flip, x.flip(-1), x)


def random_resized_crop(x: torch.Tensor, size: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """Crop a random area fraction in `scale` with aspect ratio in `ratio` (log-uniform) from
    each sample of [B, C, H, W] float x and resize it to size x size, all in one grid_sample."""
    B = x.shape[0]
    dev = generator.device if generator else torch.device("cpu")
    area = torch.empty(B, device=dev).uniform_(*scale, generator=generator)
    log_r = torch.empty(B, device=dev).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator)
    aspect = torch.exp(log_r)
    # width and height as fractions of the image, clamped to fit
    w = torch.sqrt(area * aspect).clamp(max=1.0)
    h = torch.sqrt(area / aspect).clamp(max=1.0)
    cx = (torch.rand(B, device=dev, generator=generator) * 2 - 1) * (1 - w)
    cy = (torch.rand(B, device=dev, generator=generator) * 2 - 1) * (1 - h)
    theta = torch.zeros(B, 2, 3, device=dev, dtype=x.dtype)
    theta[:, 0, 0], theta[:, 0, 2], theta[:, 1, 1], theta[:, 1, 2] = w, cx, h, cy
    grid = F.affine_grid(theta.to(x.device), (B, x.shape[1], size, size), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
