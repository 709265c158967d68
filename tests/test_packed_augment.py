"""Packed documents: the packing arithmetic (hypothesis) and rows against the token column;
batch augmentation on CPU tensors (the same code runs on the GPU)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders import Loader, MMapDataset, PackedDocuments, pack_documents
from loaders.augment import normalize, random_flip, random_resized_crop


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), max_size=200), seq_len=st.integers(1, 256))
def test_packing_keeps_order_fits_rows_and_loses_only_truncation(lengths, seq_len):
    bounds = pack_documents(np.asarray(lengths), seq_len)
    assert bounds[0] == 0 and bounds[-1] == len(lengths) and np.all(np.diff(bounds) > 0)
    clipped = np.minimum(lengths, seq_len)
    rows = [int(clipped[a:b].sum()) for a, b in zip(bounds[:-1], bounds[1:])]
    assert all(0 < r <= seq_len for r in rows)
    assert sum(rows) == sum(lengths) - sum(max(n - seq_len, 0) for n in lengths)
    # greedy: the next document never fits in the previous row
    for r, b in zip(rows[:-1], bounds[1:-1]):
        assert r + clipped[b] > seq_len


def test_packed_rows_match_the_token_column(built):
    ds = MMapDataset(built["text"])
    docs = [ds[i]["tokens"].long() for i in range(len(ds))]
    seq_len = 512
    packed = PackedDocuments(built["text"], seq_len)
    got_docs = []
    for batch in Loader(packed, 4, shuffle=False):
        cu = batch["cu_seqlens"].long().tolist()
        flat = batch["tokens"].reshape(-1)
        pos = batch["position_ids"].reshape(-1)
        for a, b in zip(cu[:-1], cu[1:]):
            if pos[a] == 0 and flat[a:b].any():
                assert pos[a:b].tolist() == list(range(b - a))
                got_docs.append(flat[a:b])
        assert torch.all(batch["lengths"] <= seq_len)
    assert len(got_docs) == len(docs)
    for got, want in zip(got_docs, docs):
        assert torch.equal(got, want[:seq_len])
    assert packed.num_truncated_tokens == sum(max(len(d) - seq_len, 0) for d in docs)


def test_normalize_flip_and_crop_on_whole_batches():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 16, 20, 3), dtype=torch.uint8, generator=g)
    x = normalize(images, mean=(0, 0, 0), std=(1, 1, 1))
    assert x.shape == (4, 3, 16, 20) and torch.allclose(x[1, 2, 3, 4], images[1, 3, 4, 2].float() / 255)
    assert torch.equal(random_flip(x, p=1.0, generator=g), x.flip(-1))
    assert torch.equal(random_flip(x, p=0.0, generator=g), x)
    ident = random_resized_crop(x[:, :, :, :16], 16, scale=(1, 1), ratio=(1, 1), generator=g)
    assert torch.allclose(ident, x[:, :, :, :16], atol=1e-5)
    out = random_resized_crop(x, 8, generator=g)
    assert out.shape == (4, 3, 8, 8) and torch.isfinite(out).all()
