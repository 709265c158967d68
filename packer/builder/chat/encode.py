"""A rendered conversation as a build stores it: its tokens (the tokenizer's ids of the whole
text, `add_special_tokens=False`, as transformers' `apply_chat_template(tokenize=True)` takes
them), a loss mask with 1 on every token that overlaps an assistant span (transformers' rule
for `return_assistant_tokens_mask`), and the token where each image placeholder starts."""

from __future__ import annotations

import numpy as np

from packer.errors import SourceError


def encode(tok, text: str, spans: list[tuple[int, int]], dtype: str,
           placeholders: list[tuple[int, int]] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, loss_mask uint8, image_positions int64) of a conversation's text."""
    enc = tok.encode(text, add_special_tokens=False)
    ids = enc.ids
    if not ids:
        raise SourceError("no tokens")
    offsets = enc.offsets
    mask = np.zeros(len(ids), np.uint8)
    k = 0
    for i, (start, end) in enumerate(offsets):  # spans and offsets both in order: one pass
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    positions = [_first_token(offsets, start, end) for start, end in placeholders]
    return np.asarray(ids, dtype=dtype), mask, np.asarray(positions, np.int64)


def _first_token(offsets: list[tuple[int, int]], start: int, end: int) -> int:
    """The first token overlapping the characters [start, end)."""
    for i, (a, b) in enumerate(offsets):
        if b > start and a < end:
            return i
    raise SourceError("an image placeholder has no token of its own (the tokenizer dropped it)")
