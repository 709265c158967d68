"""`packer show`: a few samples of a dataset as a user checks a build before training on it: each
sample's key, class name, caption or transcript decoded with the dataset's own tokenizer, image
size or clip length, and a PNG (the images in a grid under their class names, each clip's
waveform) where a person would rather look than read. Most wrong builds show at a glance: a
label that is not the folder's, a caption cut or merged with the next, a click in a clip.

Reads through `DatasetReader` alone (numpy, Pillow; a tokenizer where the dataset has one): no
torch, as the rest of packer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from packer.dataset.codec import row_images
from packer.dataset.reader import DatasetReader
from packer.errors import ConfigError

TEXT_CHARS = 160  # of a caption, transcript or document, in the listing
THUMB = 160  # the PNG's cell: images fit in THUMB x THUMB, a clip's waveform is 3 THUMB wide


def open_reader(path: str | Path) -> DatasetReader:
    """A dataset dir, an archive (unpacked once into the cache) or a URL (fetched as read)."""
    from packer import remote
    from packer.dataset.archive import is_archive, materialize

    if remote.is_url(path):
        cache = remote.open_cached(str(path), None, None)
        return DatasetReader(cache.root, cache=cache)
    root = Path(path).expanduser()
    return DatasetReader(materialize(root)[0] if is_archive(root) else root)


def spread(num_samples: int, n: int) -> list[int]:
    """n sample ids spread evenly over the dataset, its first and last among them."""
    if n < 1:
        raise ConfigError(f"-n {n}: show at least one sample")
    return sorted(set(np.linspace(0, num_samples - 1, min(n, num_samples)).round().astype(int).tolist()))


def samples(reader: DatasetReader, ids: list[int]) -> list[dict]:
    """What `packer show` lists of each sample: its id, key, class name, text, and the image or
    clip itself (arrays, for the PNG)."""
    m = reader.manifest
    names = {c.name for c in m.columns}
    decode = _text_decoder(m.tokenizer)
    out = []
    for i in ids:
        row = {"id": i, "key": bytes(reader.sample(i, "key")).decode("utf-8")}
        if "label" in names:
            label = int(reader.sample(i, "label"))
            row["label"] = label
            row["class"] = m.classes[label] if m.classes is not None and 0 <= label < len(m.classes) else None
        token_column = next((c for c in ("tokens", "chosen_tokens") if c in names), None)
        if token_column:
            tokens = np.asarray(reader.sample(i, token_column))
            row["num_tokens"] = int(tokens.size)
            row["text"] = decode(tokens) if decode else None
        mask = next((c for c in ("loss_mask", "chosen_loss_mask") if c in names), None)
        if mask:  # a conversation: the tokens its loss is taken on
            row["trained_tokens"] = int(np.asarray(reader.sample(i, mask)).sum())
        if "image" in names:
            row["image"] = np.asarray(reader.sample(i, "image"))
        elif "images" in names:  # a conversation's images: the first drawn, all counted
            column = m.column("images")
            if column.image_list:  # at their own sizes, one after another
                images = row_images(reader, *reader.locate(i))
            else:
                images = np.asarray(reader.sample(i, "images"))
            row["num_images"] = len(images)
            if len(images):
                row["image"] = np.asarray(images[0])
        if "audio" in names:
            clip = np.asarray(reader.sample(i, "audio"))
            row["audio"], row["seconds"] = clip, len(clip) / m.audio["sample_rate"]
        out.append(row)
    return out


def _text_decoder(spec: dict | None):
    """The dataset's tokenizer's decode, where its file is still at the recorded path with the
    recorded sha256 (another file would decode other words); None otherwise."""
    if not spec or not spec.get("path"):
        return None
    from packer.builder.text import file_sha256, load_tokenizer

    path = Path(spec["path"])
    try:
        if not path.is_file() or file_sha256(path) != spec.get("sha256"):
            return None
        tok = load_tokenizer(path)
    except (OSError, ConfigError):
        return None
    return lambda tokens: tok.decode(tokens.astype(np.int64).tolist(), skip_special_tokens=False)


def line(row: dict) -> str:
    """One sample as `packer show` prints it."""
    parts = [f"{row['id']:>8,}", row["key"]]
    if "label" in row:
        parts.append(f"label {row['label']}" + (f" {row['class']}" if row.get("class") is not None else ""))
    if "image" in row:
        h, w = row["image"].shape[:2]
        parts.append(f"{w}x{h}" if row.get("num_images", 1) == 1 else f"first {w}x{h}")
    if "seconds" in row:
        parts.append(f"{row['seconds']:.2f} s")
    if "num_images" in row:
        parts.append(f"{row['num_images']} image{'s' if row['num_images'] != 1 else ''}")
    if "trained_tokens" in row:
        parts.append(f"{row['trained_tokens']} of its tokens trained on")
    if "num_tokens" in row:
        text = row.get("text")
        shown = f"{text[:TEXT_CHARS]!r}{'...' if len(text) > TEXT_CHARS else ''}" if text is not None else \
            "(its tokenizer is not at the path recorded: ids only)"
        parts.append(f"{row['num_tokens']} tokens {shown}")
    return "  ".join(parts)


def draw(rows: list[dict], png: str | Path) -> Path:
    """The samples as a PNG: images in a grid, each under its class name (and the start of its
    caption); clips as waveforms under their key, class and transcript."""
    from PIL import Image, ImageDraw, ImageFont

    rows = [row for row in rows if "image" in row or "audio" in row]  # conversations without an image: listed only
    if not rows:
        raise ConfigError(f"--png {png}: a dataset of text has nothing to draw; its samples are listed instead")
    try:
        font = ImageFont.load_default(size=12)
    except TypeError:  # Pillow before 10.1: its bitmap font, one size
        font = ImageFont.load_default()
    clips = "audio" in rows[0]
    cell_w, cell_h = (3 * THUMB, THUMB // 2 + 34) if clips else (THUMB, THUMB + 34)
    cols = 1 if clips else min(len(rows), 4)
    sheet = Image.new("RGB", (cols * (cell_w + 8) + 8, -(-len(rows) // cols) * (cell_h + 8) + 8), "white")
    pen = ImageDraw.Draw(sheet)
    for k, row in enumerate(rows):
        x, y = 8 + (k % cols) * (cell_w + 8), 8 + (k // cols) * (cell_h + 8)
        if clips:
            _waveform(pen, row["audio"], (x, y, x + cell_w, y + THUMB // 2))
        else:
            image = Image.fromarray(row["image"])
            scale = THUMB / max(image.size)  # a small crop drawn big, its pixels as they are
            image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                                 Image.Resampling.NEAREST if scale > 1 else Image.Resampling.BILINEAR)
            sheet.paste(image, (x, y))
        caption = " ".join(str(v) for v in (row.get("class"), row["key"] if clips or "class" not in row else None)
                           if v is not None)
        pen.text((x, y + cell_h - 32), caption[:60], fill="black", font=font)
        if row.get("text"):
            pen.text((x, y + cell_h - 16), row["text"][:60 if clips else 24], fill="dimgray", font=font)
    path = Path(png)
    sheet.save(path)
    return path


def _waveform(pen, clip: np.ndarray, box: tuple[int, int, int, int]) -> None:
    """A clip's min and max in each pixel column, in [-1, 1] of full scale."""
    x0, y0, x1, y1 = box
    mono = clip.mean(axis=1) if clip.ndim == 2 else clip
    scale = 32768.0 if mono.dtype == np.int16 else 1.0
    columns = np.array_split(mono.astype(np.float32) / scale, x1 - x0)
    mid, half = (y0 + y1) / 2, (y1 - y0) / 2
    pen.rectangle(box, outline="lightgray")
    for dx, part in enumerate(columns):
        if part.size:
            lo, hi = float(np.clip(part.min(), -1, 1)), float(np.clip(part.max(), -1, 1))
            pen.line([(x0 + dx, mid - hi * half), (x0 + dx, mid - lo * half)], fill="navy")
