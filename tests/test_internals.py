"""The private torch, CPython and Pillow APIs mmpack relies on (`loaders.internals`,
`packer.internals`), each held to the meaning relied on: a release that changes one fails here,
by name, rather than in a guarantee (a held batch refilled, a hung build, other pixels)."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import pytest
import torch
from PIL import Image

from loaders import internals as torch_internals
from packer import internals


def test_a_storage_use_count_counts_every_live_view():
    """The ring refills a buffer only once this count is back to its value at allocation: every
    way a caller can hold part of a batch must raise it, and letting go must lower it."""
    base = torch.zeros(4, 8, 8, 3, dtype=torch.uint8)
    address = torch_internals.storage_address(base)
    idle = torch_internals.storage_use_count(address)
    held = []
    for make in (lambda t: t[:2], lambda t: t[1], lambda t: t.view(4, -1), lambda t: t.reshape(-1),
                 lambda t: t.permute(0, 3, 1, 2), lambda t: t[:2].numpy(), lambda t: torch.from_numpy(t.numpy()),
                 lambda t: t.to("cpu")[:1], lambda t: t.unsqueeze(0)):
        view = make(base)
        assert torch_internals.storage_use_count(address) > idle, make
        held.append(view)
        del view
    assert torch_internals.storage_use_count(address) > idle
    held.clear()
    assert torch_internals.storage_use_count(address) == idle
    assert torch_internals.storage_address(base[1:]) == address  # a view's storage is the buffer's


def test_a_shared_storage_is_shared_memory_of_that_size():
    storage = torch_internals.shared_storage(1000)
    assert storage.nbytes() == 1000 and storage.is_shared()
    t = torch.empty(0, dtype=torch.uint8).set_(storage).view(10, 100)
    t.fill_(7)
    assert int(t.sum()) == 7000


def test_a_pools_processes_manager_and_broken_flag_are_what_engines_reads():
    with ProcessPoolExecutor(1) as pool:
        pid = pool.submit(os.getpid).result()
        processes = internals.pool_processes(pool)
        assert [p.pid for p in processes] == [pid] and all(hasattr(p, "kill") for p in processes)
        assert internals.pool_manager(pool) is not None and internals.pool_manager(pool).is_alive()
        assert not internals.pool_broken(pool)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(BrokenProcessPool):
            pool.submit(os.getpid).result()
        assert internals.pool_broken(pool)


def test_pillows_raw_encoder_is_there_and_packs_the_box():
    """Without it the build takes the public crop + asarray path (the same bytes, slower): a
    Pillow that drops it should be noticed."""
    assert internals.raw_encoder is not None
    from packer.builder.images import rgb_pixels

    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (9, 13, 3), dtype=np.uint8), "RGB")
    np.testing.assert_array_equal(rgb_pixels(img, (2, 1, 11, 8)), np.asarray(img.crop((2, 1, 11, 8))))


def test_soundfiles_libsndfile_binding_reads_blocks_that_join_into_the_whole_read(tmp_path):
    """An MP3 read in blocks by sf_readf_float on soundfile's handle, without seeks, is the whole
    file's decode; an audio build refuses to start where the binding is gone."""
    sf = pytest.importorskip("soundfile")
    from bench import sounds

    assert internals.sndfile_reads_blocks()
    clip = next(p for p in sounds.speech() if sf.info(str(p)).frames > 20000)
    mp3 = tmp_path / "clip.mp3"
    data, rate = sf.read(str(clip), dtype="float32", always_2d=True)
    sf.write(str(mp3), data, rate, format="MP3")
    whole, _ = sf.read(str(mp3), dtype="float32", always_2d=True)
    blocks = []
    with sf.SoundFile(str(mp3)) as f:
        f.seek(0)
        while True:
            block = np.empty((4096, f.channels), np.float32)
            n = internals.sndfile_read_block(f, block)
            if not n:
                break
            blocks.append(block[:n])
    np.testing.assert_array_equal(np.concatenate(blocks), whole)
