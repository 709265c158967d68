"""The keep-aspect size rule (FORMAT.md, "Image pixels": `--keep-aspect` and the manifest's
`max_side`): what size a keep-aspect sample is stored at. Pure integer arithmetic, shared by the
build (`packer.builder.images` resizes to it, `packer.builder.plan` sizes shards by it) and the
loaders (`loaders.augment.eval_transform` resizes to it); imports neither Pillow nor torch.
"""

from __future__ import annotations


def keep_aspect_size(w: int, h: int, size: int, max_side: int | None = None) -> tuple[int, int]:
    """(width, height) of a keep-aspect sample: torchvision's `Resize(size, max_size=max_side)`
    rule, shorter side to `size`, the longer one int(size * long / short), and when that exceeds
    `max_side` the longer side `max_side` and the shorter int(max_side * size / that), at least 1.
    Also what `eval_transform` resizes to (no cap)."""
    short, long_ = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long_ / short)
    if max_side is not None and new_long > max_side:
        new_short, new_long = max(1, int(max_side * new_short / new_long)), max_side
    return (new_short, new_long) if w <= h else (new_long, new_short)
