"""The contract between views and loaders, declared (`loaders.batch.source`): every view's batch
source is a BatchSource, a loader takes only what declares it, and a loader's decode mode is
its own source's, never set on the dataset the user holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loaders import AudioClips, Loader, Mixture, MMapDataset, PackedDocuments, TokenWindows
from loaders.batch.source import BatchSource
from loaders.batched import BatchedDataset
from packer.errors import ConfigError


def test_every_views_batch_source_declares_the_contract(built):
    views = [MMapDataset(built["images"]), TokenWindows(built["text"], 16), PackedDocuments(built["text"], 32),
             AudioClips(built["audio"], 0.1), Mixture([built["images"], built["images"]], [1, 1])]
    for view in views:
        source = view.batch_source()
        assert isinstance(source, BatchSource), type(view).__name__
        assert len(source) == len(view) and isinstance(source.source_id, str)
    mixture = views[-1]
    assert mixture.order_stream() is mixture and views[0].batch_source().order_stream() is None
    assert views[0].batch_source().column_gather is not None and views[1].column_gather is None


@pytest.mark.parametrize("make", [Loader, BatchedDataset])
def test_a_loader_takes_only_a_declared_source_and_says_so_in_a_line(make, built):
    class LooksLikeOne:  # what the loaders once probed for, undeclared
        source_id = "x"

        def __len__(self):
            return 4

        def alloc(self, batch_size, memory):
            return {}

        def gather(self, ids, buffers, pool=None, num_threads=1):
            return {}

    with pytest.raises(ConfigError, match="a Loader reads an MMapDataset"):
        make(LooksLikeOne(), 2)
    with pytest.raises(ConfigError, match="columns= applies to an MMapDataset only"):
        make(TokenWindows(built["text"], 16), 2, columns=["tokens"])


def test_a_device_decode_is_the_loaders_own_source_never_the_users_dataset(built, monkeypatch):
    from loaders import device_decode

    monkeypatch.setattr(device_decode, "decoder", lambda: lambda data, device: [torch.zeros(3, 2, 2)] * len(data))
    ds = MMapDataset(built["jpeg"])
    on_device = Loader(ds, 4, shuffle=False, device="cpu", jpeg_decode="device")
    threads = Loader(ds, 4, shuffle=False)
    assert on_device.source.device_decode and not threads.source.device_decode
    assert on_device.source is not threads.source and not ds.batch_source().device_decode
    first = next(iter(threads))["image"]  # the threads' decode: pixels, whatever the other loader does
    assert first.dtype == torch.uint8 and first.shape[1:] == ds[0]["image"].shape
    assert np.array_equal(first[0].numpy(), ds[0]["image"])
