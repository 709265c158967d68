"""Packed documents: the packing arithmetic (hypothesis) and rows against the token column;
batch augmentation on CPU tensors (the same code runs on the GPU)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
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
        flat = batch["tokens"].reshape(-1).clone()  # the batch's buffer is refilled two batches on
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


def _reference_rows(docs: list[torch.Tensor], rows: list[int], seq_len: int) -> dict:
    """The packed rows, document by document, from per-sample reads: the oracle for gather."""
    bounds = pack_documents(np.array([len(d) for d in docs]), seq_len).tolist()
    tokens = torch.zeros(len(rows), seq_len, dtype=torch.int64)
    positions = torch.zeros_like(tokens)
    lengths, cu = [], [0]
    for i, r in enumerate(rows):
        used = 0
        for d in docs[bounds[r]:bounds[r + 1]]:
            d = d[:seq_len]
            tokens[i, used:used + len(d)] = d
            positions[i, used:used + len(d)] = torch.arange(len(d))
            used += len(d)
            cu.append(i * seq_len + used)
        if used < seq_len:
            cu.append((i + 1) * seq_len)
        lengths.append(used)
    return {"tokens": tokens, "position_ids": positions, "lengths": torch.tensor(lengths),
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq_len=st.sampled_from([1, 5, 16, 64, 300]), data=st.data())
def test_packed_gather_into_reused_buffers_matches_document_by_document_packing(short_docs, seq_len, data):
    root, docs = short_docs
    packed = PackedDocuments(root, seq_len)
    buffers = packed.alloc(5, "ring")  # filled batch after batch: nothing of an earlier batch may stay
    for _ in range(3):
        rows = data.draw(st.lists(st.integers(0, len(packed) - 1), min_size=1, max_size=5))
        got = packed.gather(np.array(rows), buffers)
        want = _reference_rows(docs, rows, seq_len)
        for name, value in want.items():
            assert torch.equal(got[name], value), name
            assert got[name].data_ptr() == buffers[name].data_ptr(), name  # in the buffer, not a copy


def test_packed_rows_take_documents_from_several_shards(short_docs):
    """The property test above covers rows whose documents come from two or more shards."""
    root, docs = short_docs
    shard_ends = np.cumsum([s.num_samples for s in MMapDataset(root).manifest.shards])
    bounds = pack_documents(np.array([len(d) for d in docs]), 300)
    first = np.searchsorted(shard_ends, bounds[:-1], side="right")
    last = np.searchsorted(shard_ends, bounds[1:] - 1, side="right")
    assert len(shard_ends) > 20 and np.sum(first != last) > 10 and np.any(last - first >= 2)


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
