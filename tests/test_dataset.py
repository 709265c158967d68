"""MMapDataset in DataLoader workers: pickles small, re-maps per worker, same samples."""

from __future__ import annotations

import pickle

import torch

from loaders import MMapDataset


def test_pickles_as_paths_only(built):
    ds = MMapDataset(built["text"])
    assert len(pickle.dumps(ds)) < 500
    again = pickle.loads(pickle.dumps(ds))
    assert again[5]["key"] == ds[5]["key"] and torch.equal(again[5]["tokens"], ds[5]["tokens"])


def test_dataloader_with_two_workers_matches_direct_reads(built):
    ds = MMapDataset(built["images"], columns=["image", "label"])
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, shuffle=False)
    seen = 0
    for batch in loader:
        for j in range(batch["label"].shape[0]):
            direct = ds[seen + j]
            assert torch.equal(batch["image"][j], direct["image"]) and batch["label"][j] == direct["label"]
        seen += batch["label"].shape[0]
    assert seen == len(ds)


def test_unknown_column_is_named(built):
    import pytest

    with pytest.raises(KeyError, match="no column"):
        MMapDataset(built["images"], columns=["tokens"])


def test_loaders_import_no_decoders():
    import subprocess
    import sys

    code = "import sys, loaders; print(sorted(m for m in ('PIL', 'tokenizers', 'pyarrow') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
