"""Packed documents: the packing arithmetic (hypothesis) and rows against the token column;
batch augmentation on CPU tensors (the same code runs on the GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loaders import Loader, MMapDataset, PackedDocuments, pack_documents
from loaders.augment import normalize, random_flip, random_resized_crop


policies = st.sampled_from(["best-fit", "in-order"])


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(0, 700), max_size=200), seq_len=st.integers(1, 256), policy=policies)
def test_packing_keeps_every_token_once_and_splits_only_what_does_not_fit(lengths, seq_len, policy):
    pk = pack_documents(np.asarray(lengths, dtype=np.int64), seq_len, policy=policy)
    assert pk.row_ptr[0] == 0 and pk.row_ptr[-1] == len(pk.doc) and np.all(np.diff(pk.row_ptr) > 0)
    rows = pk.row_tokens()
    assert np.all((rows > 0) & (rows <= seq_len)) and rows.sum() == sum(lengths)  # tokens in = tokens out
    assert pk.truncated_tokens == 0
    for d, n in enumerate(lengths):  # a document's pieces cover it once, in order, as few as can be
        mine = np.flatnonzero(pk.doc == d)
        starts, ends = pk.start[mine], pk.start[mine] + pk.length[mine]
        assert np.array_equal(np.sort(starts), np.arange(0, n, seq_len)) and ends.max(initial=n) == n
        assert np.all(pk.length[mine] > 0) and len(mine) == -(-n // seq_len)
    assert pk.num_rows >= -(-sum(lengths) // seq_len)
    if policy == "in-order":  # document order kept; the next piece never fits in the row before
        assert np.all(np.diff(pk.doc) >= 0)
        first = pk.length[pk.row_ptr[1:-1]]
        assert np.all(rows[:-1] + first > seq_len)
    else:  # best fit: no worse than in document order
        assert pk.num_rows <= pack_documents(np.asarray(lengths, dtype=np.int64), seq_len, policy="in-order").num_rows


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(0, 700), max_size=100), seq_len=st.integers(1, 256), policy=policies)
def test_truncation_keeps_the_head_of_each_document_and_counts_the_rest(lengths, seq_len, policy):
    pk = pack_documents(np.asarray(lengths, dtype=np.int64), seq_len, policy=policy, truncate=True)
    assert np.all(pk.start == 0) and sorted(pk.doc.tolist()) == [d for d, n in enumerate(lengths) if n]
    assert np.array_equal(pk.length, np.minimum(np.asarray(lengths, dtype=np.int64)[pk.doc], seq_len))
    assert pk.truncated_tokens == sum(max(n - seq_len, 0) for n in lengths)


def _reference_rows(docs: list[torch.Tensor], packing, rows: list[int], seq_len: int) -> dict:
    """The packed rows, piece by piece, from per-sample reads: the oracle for gather."""
    tokens = torch.zeros(len(rows), seq_len, dtype=torch.int64)
    positions = torch.zeros_like(tokens)
    lengths, cu = [], [0]
    for i, r in enumerate(rows):
        used = 0
        for p in range(packing.row_ptr[r], packing.row_ptr[r + 1]):
            a, n = int(packing.start[p]), int(packing.length[p])
            tokens[i, used:used + n] = docs[packing.doc[p]][a:a + n]
            positions[i, used:used + n] = torch.arange(n)
            used += n
            cu.append(i * seq_len + used)
        if used < seq_len:
            cu.append((i + 1) * seq_len)
        lengths.append(used)
    return {"tokens": tokens, "position_ids": positions, "lengths": torch.tensor(lengths),
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq_len=st.sampled_from([1, 5, 16, 64, 300]), policy=policies, data=st.data())
def test_packed_gather_into_reused_buffers_matches_piece_by_piece_packing(short_docs, built, seq_len, policy, data):
    """Short documents in small shards, and long ones (cut into pieces, copied as slices)."""
    for root, docs in (short_docs, (built["text"], _docs(built["text"]))):
        packed = PackedDocuments(root, seq_len, policy=policy)
        buffers = packed.alloc(5, "huge")  # filled batch after batch: nothing of an earlier batch may stay
        for _ in range(3):
            rows = data.draw(st.lists(st.integers(0, len(packed) - 1), min_size=1, max_size=5))
            got = packed.gather(np.array(rows), buffers)
            want = _reference_rows(docs, packed.packing, rows, seq_len)
            for name, value in want.items():
                assert torch.equal(got[name], value), name
                assert got[name].data_ptr() == buffers[name].data_ptr(), name  # in the buffer, not a copy


def _docs(root) -> list[torch.Tensor]:
    ds = MMapDataset(root)
    return [ds[i]["tokens"] for i in range(len(ds))]


@pytest.mark.parametrize("policy", ["best-fit", "in-order"])
def test_a_loader_epoch_of_packed_rows_holds_every_token_once_and_never_attends_across_documents(built, policy):
    """Documents far longer than seq_len (stdlib sources, thousands of tokens, at seq_len 64):
    every token of the dataset comes out once, and every attention segment is one contiguous
    piece of one document."""
    docs = [d.tolist() for d in _docs(built["text"])]
    seq_len = 64
    assert max(len(d) for d in docs) > 20 * seq_len
    packed = PackedDocuments(built["text"], seq_len, policy=policy)
    out, rows = [], 0
    for batch in Loader(packed, 16, seed=3):
        cu = batch["cu_seqlens"].tolist()
        flat, pos = batch["tokens"].reshape(-1).tolist(), batch["position_ids"].reshape(-1).tolist()
        used = batch["lengths"].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            row, at = divmod(a, seq_len)
            if at >= used[row]:  # the row's padding
                assert not any(flat[a:b]) and b == (row + 1) * seq_len
                continue
            assert (b - 1) // seq_len == row and pos[a:b] == list(range(b - a))
            out.append(tuple(flat[a:b]))
        rows += len(used)
        assert sum(used) == sum(b - a for a, b in zip(cu[:-1], cu[1:])) - sum(
            (r + 1) * seq_len - (r * seq_len + u) for r, u in enumerate(used) if u < seq_len)
    assert rows == len(packed)
    pieces = sorted(out)
    want = sorted(tuple(d[a:a + seq_len]) for d in docs for a in range(0, len(d), seq_len))
    assert pieces == want  # tokens in = tokens out, piece for piece
    assert sum(map(len, pieces)) == sum(map(len, docs)) == packed.num_tokens and packed.num_truncated_tokens == 0
    assert packed.padding_fraction < (0.02 if policy == "best-fit" else 0.2)


def test_truncate_is_asked_for_and_reported(built):
    docs = _docs(built["text"])
    packed = PackedDocuments(built["text"], 512, truncate=True)
    assert packed.num_truncated_tokens == sum(max(len(d) - 512, 0) for d in docs) > 0
    assert packed.packing.row_tokens().sum() == sum(min(len(d), 512) for d in docs)


def test_packed_rows_take_documents_from_several_shards(short_docs):
    """The property test above covers rows whose pieces come from two or more shards."""
    root, docs = short_docs
    shard_ends = np.cumsum([s.num_samples for s in MMapDataset(root).manifest.shards])
    for policy in ("best-fit", "in-order"):
        pk = pack_documents(np.array([len(d) for d in docs]), 300, policy=policy)
        shard = np.searchsorted(shard_ends, pk.doc, side="right")
        spread = np.maximum.reduceat(shard, pk.row_ptr[:-1]) - np.minimum.reduceat(shard, pk.row_ptr[:-1])
        assert len(shard_ends) > 20 and np.sum(spread > 0) > 10 and np.any(spread >= 2)


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
