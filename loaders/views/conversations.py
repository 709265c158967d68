"""What `PackedDocuments` adds for a dataset of conversations (`packer build ... --chat-template`):
each row's `labels` (the token where its loss mask is 1, -100 elsewhere and in the padding, as
Hugging Face models take them), whole conversations (one longer than `seq_len` is split, or
dropped and counted with `truncate=True`), and, where the conversations have images, each
image counted as `image_tokens` tokens toward `seq_len` (the placeholder's own token and
N - 1 more: a row fits after the model puts N embeddings in its place), and carried in the
batch in row order with where it goes (`images`, `image_rows`, `image_positions`): S x S images
stacked, images of their own sizes (a keep-aspect or JPEG build) as a canvas with `images_size`,
JPEG decoded here, in the Loader's threads."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

from loaders.batch.canvas import images_canvas
from loaders.batch.ragged import ranges
from packer.dataset.codec import image_list
from packer.errors import ConfigError

IGNORE = -100  # the label Hugging Face's losses skip


class Conversations:
    """A chat dataset's masks and images, by document (conversation), for a packing."""

    def __init__(self, reader, lengths: np.ndarray, seq_len: int, *, truncate: bool,
                 image_tokens: int | Callable[[int, int], int] | None):
        shards = range(len(reader.manifest.shards))
        self.masks = [reader.column(k, "loss_mask").values for k in shards]
        names = {c.name for c in reader.manifest.columns}
        self.has_images = "images" in names
        if image_tokens is not None and not self.has_images:
            raise ConfigError(f"{reader.root}: image_tokens= counts images toward seq_len, and its conversations "
                              "have none")
        effective = np.asarray(lengths, np.int64).copy()
        if self.has_images:
            column = reader.manifest.column("images")
            self.listed = column.encoding if column.image_list else None  # images of their own sizes
            self.where = f"{reader.root}: column images"
            self._images = [reader.column(k, "images") for k in shards]
            self._positions = [reader.column(k, "image_positions") for k in shards]
            counts = np.concatenate([np.diff(np.asarray(p.offsets, np.int64)) for p in self._positions])
            self.first_image = np.concatenate([[0], np.cumsum(counts)])
            if self.listed:
                self._shapes = [reader.column(k, "image_shapes") for k in shards]
                self._nbytes = [reader.column(k, "image_nbytes") for k in shards]
                effective += self._extra_tokens(counts, image_tokens)
            else:
                size = column.shape[1:3]
                per_image = image_tokens(*size) if callable(image_tokens) else (image_tokens or 1)
                effective += counts * (int(per_image) - 1)
        # whole conversations: with images (an image cannot be cut from its text) or truncate=True,
        # one longer than a row is dropped, and counted
        over = effective > seq_len if (truncate or self.has_images) else np.zeros(len(effective), bool)
        self.dropped = int(over.sum())
        self.dropped_tokens = int(np.asarray(lengths)[over].sum())
        if self.dropped:  # counted (num_dropped), and said: a row too short can leave out most of a dataset
            warnings.warn(f"{reader.root}: {self.dropped:,} of {len(over):,} conversations are longer than "
                          f"seq_len={seq_len}" + (" with their images' image_tokens" if self.has_images else "") +
                          " and are left out (num_dropped); raise seq_len" +
                          (" or lower image_tokens" if self.has_images else ""), stacklevel=4)
        effective[over] = 0
        self.effective = effective

    def _extra_tokens(self, counts: np.ndarray, image_tokens) -> np.ndarray:
        """Each conversation's tokens past its placeholders' own: image_tokens - 1 an image, or
        image_tokens(h, w) - 1 of each image's own size (called once a distinct size)."""
        if not callable(image_tokens):
            return counts * (int(image_tokens or 1) - 1)
        shapes = np.concatenate([np.asarray(s.values, np.int64) for s in self._shapes]).reshape(-1, 3)[:, :2]
        if len(shapes) != int(counts.sum()):
            raise ConfigError(f"{self.where}: {len(shapes)} image shapes for {int(counts.sum())} placeholders; "
                              "run 'packer verify'")
        sizes, which = np.unique(shapes, axis=0, return_inverse=True)
        tokens = np.asarray([int(image_tokens(int(h), int(w))) for h, w in sizes], np.int64)[np.ravel(which)] - 1
        owner = np.repeat(np.arange(len(counts)), counts)
        return np.bincount(owner, weights=tokens, minlength=len(counts)).astype(np.int64)

    def labels(self, t: np.ndarray, dst: np.ndarray, src: np.ndarray, length: np.ndarray, shard: np.ndarray,
               out: np.ndarray) -> None:
        """Each piece's labels (its tokens where its mask is 1, else -100) into the flat `out`,
        already -100 in the padding."""
        out.fill(IGNORE)
        for k in np.unique(shard).tolist():
            sel = np.flatnonzero(shard == k)
            to, frm = ranges(dst[sel], length[sel]), ranges(src[sel], length[sel])
            kept = np.asarray(self.masks[k][frm], dtype=bool)
            out[to[kept]] = t[to[kept]]

    def images(self, docs: np.ndarray, doc_shard: np.ndarray, doc_row: np.ndarray, rows: np.ndarray,
               within: np.ndarray) -> dict[str, torch.Tensor]:
        """The batch's images, row after row (each row's conversations in their order), the row
        (in the batch) each belongs to and its placeholder's place in that row's tokens."""
        pixels, where_row, where = [], [], []
        for d, row, offset in zip(docs.tolist(), rows.tolist(), within.tolist()):
            k, r = int(doc_shard[d]), int(doc_row[d])
            pos = self._positions[k].sample(r)
            if len(pos):
                if self.listed:
                    pixels.extend(image_list(self._images[k].sample(r), self._shapes[k].sample(r),
                                             self._nbytes[k].sample(r), self.listed, f"{self.where}: shard {k} row {r}"))
                else:
                    pixels.append(self._images[k].sample(r))
                where_row.append(np.full(len(pos), row, np.int64))
                where.append(np.asarray(pos, np.int64) + offset)
        if self.listed:
            return {**images_canvas("images", pixels),
                    "image_rows": torch.from_numpy(np.concatenate(where_row) if where_row else np.zeros(0, np.int64)),
                    "image_positions": torch.from_numpy(np.concatenate(where) if where else np.zeros(0, np.int64))}
        if not pixels:
            shape = (0, *self._images[0].sample(0).shape[1:]) if self._images else (0, 0, 0, 3)
            return {"images": torch.zeros(shape, dtype=torch.uint8), "image_rows": torch.zeros(0, dtype=torch.int64),
                    "image_positions": torch.zeros(0, dtype=torch.int64)}
        return {"images": torch.from_numpy(np.concatenate(pixels)),
                "image_rows": torch.from_numpy(np.concatenate(where_row)),
                "image_positions": torch.from_numpy(np.concatenate(where))}
