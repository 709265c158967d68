"""Reading an audio dataset: whole clips padded to the batch's longest with `audio_lengths`
(mono [B, T], stereo [B, T, C]), and AudioClips' crops: a crop is the same slice of the packed
clip, drawn from (seed, epoch, clip) alone, so thread, worker and rank counts change nothing.
A crop carries its clip's other columns, a transcript's tokens whole. The resume contract runs on
both (tests/contract.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import sounds
from loaders import AudioClips, BatchedDataset, Loader, Mixture, MMapDataset, StatefulDataLoader, to_float
from packer.cli import main
from packer.errors import ConfigError


def _check_padded(batch, ds, keys):
    for i, key in enumerate(batch["key"]):
        clip = ds[keys[key]]["audio"]
        n = int(batch["audio_lengths"][i])
        assert n == clip.shape[0] and torch.equal(batch["audio"][i, :n], clip), key
        assert not batch["audio"][i, n:].any()


@pytest.fixture(scope="module")
def stereo(audio_raw, tmp_path_factory):
    out = tmp_path_factory.mktemp("stereo") / "out"
    assert main(["build", str(audio_raw), str(out), "--sample-rate", "8000", "--channels", "2", "--shard-size", "64KB",
                 "-q"]) == 0
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_whole_clips_batch_padded_with_their_lengths(built, stereo, threads):
    for out, tail in ((built["audio"], ()), (stereo, (2,))):
        ds = MMapDataset(out)
        keys = {ds[i]["key"]: i for i in range(len(ds))}
        seen = set()
        for batch in Loader(ds, 7, seed=2, num_threads=threads):
            assert batch["audio"].shape[2:] == tail and batch["audio"].shape[1] == int(batch["audio_lengths"].max())
            _check_padded(batch, ds, keys)
            seen.update(batch["key"])
        assert seen == set(keys)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_crop_is_the_same_slice_of_the_packed_clip(built, copies, threads):
    clips = AudioClips(built["audio"], 0.25, seed=4)
    ds = MMapDataset(built["audio"])
    keys = {ds[i]["key"]: i for i in range(len(ds))}
    assert clips.frames == 4000 and len(clips) == len(ds)
    lengths = np.array([ds[i]["audio"].shape[0] for i in range(len(ds))])
    assert (lengths < 4000).any() and (lengths > 8000).any()  # short clips padded, long ones cropped
    loader = Loader(clips, 8, seed=1, num_threads=threads)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            assert batch["audio"].shape[1:] == (4000,) and batch["label"].dtype == torch.int64
            for i, key in enumerate(batch["key"]):
                sid = keys[key]
                clip, n = ds[sid]["audio"], int(batch["audio_lengths"][i])
                start = int(clips.offsets(np.array([sid]), epoch)[0])
                assert n == min(4000, len(clip)) and 0 <= start <= max(0, len(clip) - 4000)
                assert torch.equal(batch["audio"][i, :n], clip[start:start + n]) and not batch["audio"][i, n:].any()


def test_crops_change_with_the_epoch_and_seed_only(built):
    ids = np.arange(len(MMapDataset(built["audio"])))
    a, b = AudioClips(built["audio"], 0.25, seed=4), AudioClips(built["audio"], 0.25, seed=5)
    assert np.array_equal(a.offsets(ids, 3), AudioClips(built["audio"], 0.25, seed=4).offsets(ids, 3))
    assert not np.array_equal(a.offsets(ids, 0), a.offsets(ids, 1))
    assert not np.array_equal(a.offsets(ids, 0), b.offsets(ids, 0))

    def crops(loader):
        out = {}
        for epoch in range(2):
            loader.set_epoch(epoch)
            for batch in loader:
                for key, row, n in zip(batch["key"], batch["audio"], batch["audio_lengths"].tolist()):
                    out[(epoch, key)] = row[:n].clone()
        return out

    one = crops(Loader(a, 8, seed=1, num_threads=1))
    for other in (crops(Loader(a, 5, seed=9, num_threads=2)),
                  crops(StatefulDataLoader(BatchedDataset(a, 8, seed=1), num_workers=2))):
        assert one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)
    ranks = {}
    for rank in range(2):
        ranks.update(crops(Loader(a, 4, seed=1, rank=rank, world_size=2)))
    assert all(torch.equal(one[k], ranks[k]) for k in ranks) and {k[1] for k in ranks} == {k[1] for k in one}


def test_a_stereo_crop_and_to_float(stereo):
    clips = AudioClips(stereo, 0.5)
    batch = next(iter(Loader(clips, 4)))
    assert batch["audio"].shape == (4, 4000, 2) and batch["audio"].dtype == torch.int16
    x = to_float(batch["audio"])
    assert x.dtype == torch.float32 and x.abs().max() <= 1 and torch.equal(x * 32768, batch["audio"].float())
    with pytest.raises(ValueError, match="int16 or float32"):
        to_float(batch["audio_lengths"])
    one = clips[0]
    assert one["audio"].shape == (4000, 2) and isinstance(one["key"], str)


@pytest.fixture(scope="module")
def transcribed(tmp_path_factory, minilm):
    """Spoken clips with their transcripts (sidecar .txt), tokenized: columns audio, tokens, key."""
    raw = sounds.make_audio_folders(tmp_path_factory.mktemp("raw") / "spoken", 12, seed=3, transcripts=True)
    out = raw.parent / "out"
    assert main(["build", str(raw), str(out), "--sample-rate", "8000", "--tokenizer", str(minilm), "-q"]) == 0
    return out


def test_a_crop_carries_its_clips_whole_transcript(transcribed):
    """A transcribed dataset's tokens come beside each crop, whole (as MMapDataset has them; the
    crop may cut the words), padded with their lengths; asked for, any column comes."""
    ds = MMapDataset(transcribed)
    keys = {ds[i]["key"]: i for i in range(len(ds))}
    clips = AudioClips(transcribed, 0.5, seed=2)
    seen = set()
    for batch in Loader(clips, 5, seed=1):
        assert set(batch) == {"audio", "audio_lengths", "tokens", "tokens_lengths", "key"}
        for i, key in enumerate(batch["key"]):
            tokens, n = ds[keys[key]]["tokens"], int(batch["tokens_lengths"][i])
            assert n == len(tokens) > 0 and torch.equal(batch["tokens"][i, :n], tokens), key
            assert not batch["tokens"][i, n:].any()
            seen.add(key)
    assert seen == set(keys)
    one = AudioClips(transcribed, 0.5, columns=["tokens"])[3]
    assert set(one) == {"audio", "audio_lengths", "tokens", "tokens_lengths"}
    assert torch.equal(one["tokens"][:int(one["tokens_lengths"])], ds[3]["tokens"])


def test_audio_clips_refuse_what_they_cannot_crop(built):
    with pytest.raises(ConfigError, match="holds images, not audio"):
        AudioClips(built["images"], 1.0)
    with pytest.raises(ConfigError, match=r"cannot carry columns \['tokens', 'audio'\]"):  # none; the crop
        AudioClips(built["audio"], 1.0, columns=["tokens", "audio"])
    with pytest.raises(ConfigError, match="not AudioClips"):  # its gather is told no epoch
        Mixture([AudioClips(built["audio"], 1.0), AudioClips(built["audio"], 2.0)], [1, 1])
    with pytest.raises(ValueError):
        AudioClips(built["audio"], 0)


def test_a_mixture_of_audio_at_two_rates_is_refused(built, stereo, audio_raw, tmp_path):
    other = tmp_path / "at8k"
    assert main(["build", str(audio_raw), str(other), "--sample-rate", "8000", "-q"]) == 0
    with pytest.raises(ConfigError, match="one rate"):  # the same frames would be another time
        Mixture([MMapDataset(built["audio"]), MMapDataset(other)], [1, 1])
