"""The image stage's pixel packing: the same bytes as Pillow's public crop + asarray."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from packer.builder import images


@st.composite
def images_and_boxes(draw):
    w, h = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**32 - 1))
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    left, right = sorted(draw(st.lists(st.integers(0, w), min_size=2, max_size=2, unique=True)))
    top, bottom = sorted(draw(st.lists(st.integers(0, h), min_size=2, max_size=2, unique=True)))
    return Image.fromarray(pixels, "RGB"), (left, top, right, bottom)


@given(images_and_boxes())
def test_rgb_pixels_are_the_crop(case):
    img, box = case
    got = images.rgb_pixels(img, box)
    want = np.asarray(img.crop(box))
    assert got.shape == want.shape == (box[3] - box[1], box[2] - box[0], 3)
    np.testing.assert_array_equal(got, want)


def test_rgb_pixels_without_the_encoder_hook(monkeypatch):
    img = Image.fromarray(np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3), "RGB")
    fast = images.rgb_pixels(img, (1, 2, 6, 5))
    monkeypatch.setattr(images, "raw_encoder", None)
    np.testing.assert_array_equal(images.rgb_pixels(img, (1, 2, 6, 5)), fast)


@pytest.mark.parametrize("size", [None, 16])
def test_decode_image_writable_or_not(tmp_path, size):
    path = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(path)
    mine = images.decode_image(path, size)
    shared = images.decode_image(path, size, writable=False)
    assert mine.flags.writeable and not shared.flags.writeable
    np.testing.assert_array_equal(mine, shared)
    assert mine.shape == ((20, 30, 3) if size is None else (16, 16, 3))


def test_background_composites_transparency_before_alpha_is_dropped(tmp_path):
    """Default: alpha dropped as Pillow's convert("RGB") does (the colour under a transparent
    pixel shows); --background R,G,B: composited over that colour."""
    from bench import data
    from packer.builder.images import decode_image

    photo = Image.open(data.fetch(data.SKIMAGE) / "astronaut.png").convert("RGBA").resize((40, 40))
    alpha = np.zeros((40, 40), np.uint8)
    alpha[:, 20:] = 255  # the left half fully transparent
    photo.putalpha(Image.fromarray(alpha))
    path = tmp_path / "half.png"
    photo.save(path)
    plain = decode_image(path, None)
    white = decode_image(path, None, background=(255, 255, 255))
    assert np.array_equal(plain, np.asarray(photo.convert("RGB")))
    assert (white[:, :20] == 255).all() and np.array_equal(white[:, 20:], plain[:, 20:])


def test_a_photo_over_pillows_warning_packs_and_max_pixels_sets_the_limit(tmp_path):
    """A 9,600 x 9,600 photo (92 MP, over Pillow's 89.5 MP warning) was refused as a
    "decompression bomb"; the limit is --max-pixels, by default Pillow's own refusal (179 MP),
    and a skip over it says how to pack it."""
    from loaders import MMapDataset
    from packer.cli import main

    raw = tmp_path / "raw" / "a"
    raw.mkdir(parents=True)
    Image.new("RGB", (9600, 9600), (200, 120, 40)).save(raw / "big.jpg", quality=50)
    Image.new("RGB", (64, 48), (1, 2, 3)).save(raw / "small.png")
    assert main(["build", str(raw.parent), str(tmp_path / "out"), "--image-size", "16", "-q"]) == 0
    assert len(MMapDataset(tmp_path / "out")) == 2
    assert main(["build", str(raw.parent), str(tmp_path / "cap"), "--image-size", "16", "-q",
                 "--max-pixels", "90000000"]) == 0
    m = MMapDataset(tmp_path / "cap").manifest
    assert [s.key for s in m.skipped] == ["a/big.jpg"] and "92,160,000 pixels, over the limit of 90,000,000" in \
        m.skipped[0].reason and "--max-pixels" in m.skipped[0].reason
