"""Detection boxes move with the pixels under them (`loaders.augment.move_boxes`,
`detection_transform`): for any crop and flip, a box lands where its object's pixels land, on
the batch's device, batched; torchvision's box conversion and flip agree where it is installed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loaders.augment import detection_transform, move_boxes


def _canvas(objects: list[tuple[int, int, int, int]], shapes: list[tuple[int, int]]):
    """A padded canvas of grey samples, each with one white rectangle (x1, y1, x2, y2)."""
    H, W = max(h for h, _ in shapes), max(w for _, w in shapes)
    canvas = torch.zeros(len(shapes), H, W, 3, dtype=torch.uint8)
    for b, ((h, w), (x1, y1, x2, y2)) in enumerate(zip(shapes, objects)):
        canvas[b, :h, :w] = 60
        canvas[b, y1:y2, x1:x2] = 255
    return canvas, torch.tensor(shapes)


@given(st.data())
def test_a_box_lands_where_its_objects_pixels_land(data):
    B = data.draw(st.integers(1, 4))
    shapes, objects = [], []
    for _ in range(B):
        h, w = data.draw(st.integers(40, 90)), data.draw(st.integers(40, 90))
        x1, y1 = data.draw(st.integers(0, w - 20)), data.draw(st.integers(0, h - 20))
        objects.append((x1, y1, data.draw(st.integers(x1 + 16, w)), data.draw(st.integers(y1 + 16, h))))
        shapes.append((h, w))
    canvas, sizes = _canvas(objects, shapes)
    boxes = torch.tensor(objects, dtype=torch.float32)[:, None, :]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    x, moved, keep = detection_transform(canvas, sizes, boxes, torch.ones(B, dtype=torch.int64), size=64,
                                         scale=(0.5, 1.0), generator=g, mean=(0, 0, 0), std=(1, 1, 1))
    for b in range(B):
        white = x[b, 0] > 0.8  # the object's pixels (grey is 60/255)
        if not keep[b, 0]:
            assert white.sum() <= 64  # cropped away: at most a sliver of blur
            continue
        ys, xs = torch.nonzero(white, as_tuple=True)
        if len(ys) == 0:
            continue
        seen = torch.tensor([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=torch.float32)
        assert (seen - moved[b, 0]).abs().max() <= 2.5, (seen, moved[b, 0])


def test_padding_rows_and_boxes_cropped_away_are_not_kept():
    boxes = torch.tensor([[[0, 0, 10, 10], [50, 50, 60, 60], [0, 0, 0, 0]]], dtype=torch.float32)
    moved, keep = move_boxes(boxes, torch.tensor([[0, 0, 20, 20]]), torch.tensor([True]), 40,
                             lengths=torch.tensor([2]))
    assert keep.tolist() == [[True, False, False]]
    assert moved[0, 0].tolist() == [20.0, 0.0, 40.0, 20.0]  # x: 0..10 of 20 -> 0..20 of 40, flipped: 20..40


def test_torchvisions_box_conversion_and_flip_agree():
    tv = pytest.importorskip("torchvision.ops")
    F = pytest.importorskip("torchvision.transforms.v2.functional")
    tv_tensors = pytest.importorskip("torchvision.tv_tensors")
    xywh = torch.tensor([[3.0, 4.0, 10.0, 7.0], [0.0, 0.0, 5.0, 5.0]])
    xyxy = tv.box_convert(xywh, "xywh", "xyxy")
    moved, _ = move_boxes(xyxy[None], torch.tensor([[0, 0, 30, 40]]), torch.tensor([True]), 40)
    flipped = F.horizontal_flip(tv_tensors.BoundingBoxes(xyxy, format="XYXY", canvas_size=(30, 40)))
    assert torch.allclose(moved[0] * torch.tensor([1.0, 30 / 40, 1.0, 30 / 40]), flipped.as_subclass(torch.Tensor))
