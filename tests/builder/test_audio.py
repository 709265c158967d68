"""Audio builds end to end through the real CLI, on real recordings (bench.sounds: speech and
sounds from Debian packages, music from the pygame wheel; WAV, FLAC, Ogg Vorbis, MP3 at 8 to 96
kHz): every packed clip equals soundfile + soxr of its whole file (MP3s longer than two decode
blocks included), float32 within [-1, 1) with what was clipped counted, a worker's memory grows
by the stored clip only, transcripts are tokenized, and hostile files are skips with reasons,
never a hang or an allocation of what a header claims."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

from bench import sounds
from loaders import MMapDataset
from packer.cli import main
from packer.dataset.reader import load_manifest
from tests.trees import one_line_error

ROOT = Path(__file__).resolve().parents[2]


FLOAT_TOP = np.float32(1 - 2**-24)  # the largest float32 below 1


def reference(path: Path, rate: int, channels: int = 1, dtype: str = "int16") -> np.ndarray:
    """What FORMAT.md asks a packed clip to equal: soundfile's whole float32 decode (NaN as 0,
    +-Inf as +-1), the channels' mean (or a mono file copied to both), soxr's HQ resample of the
    whole clip, then int16 at libsndfile's scale or float32 clipped to [-1, 1)."""
    data, native = sf.read(path, dtype="float32", always_2d=True)
    data = np.nan_to_num(data, nan=0.0, posinf=1.0, neginf=-1.0)
    if data.shape[1] != channels:
        data = data.mean(axis=1, keepdims=True, dtype=np.float32) if channels == 1 else np.repeat(data, 2, axis=1)
    if native != rate:
        data = soxr.resample(data, native, rate, quality="HQ")
    if dtype == "int16":
        data = np.clip(np.rint(data * 32768.0), -32768, 32767).astype(np.int16)
    else:
        data = np.clip(data, -1, FLOAT_TOP)
    return data[:, 0] if channels == 1 else data


def test_an_audio_folder_packs_every_clip_as_soundfile_and_soxr_decode_it(built, audio_raw, capsys):
    m = load_manifest(built["audio"])
    files = sorted(p for p in audio_raw.rglob("*") if p.is_file())
    assert m.kind == "audio" and m.audio == {"sample_rate": 16000, "channels": 1, "dtype": "<i2"}
    assert m.classes == ("effects", "music", "speech") and len(m.shards) > 1
    assert m.counts == {"found": len(files), "packed": len(files), "skipped": 0}
    assert {p.suffix for p in files} >= {".wav", ".flac", ".oga", ".ogg", ".mp3"}
    assert len({sf.info(p).samplerate for p in files}) >= 4  # 8 to 96 kHz, 16 kHz among none of them
    ds = MMapDataset(built["audio"])
    for i in range(len(ds)):
        sample = ds[i]
        path = audio_raw / sample["key"]
        want = reference(path, 16000)
        got = sample["audio"].numpy()
        assert got.dtype == np.int16 and got.shape == want.shape, sample["key"]
        assert np.abs(got.astype(np.int32) - want).max() <= 1, sample["key"]  # within 1 LSB
        assert m.classes[int(sample["label"])] == sample["key"].split("/")[0]
    assert main(["info", str(built["audio"])]) == 0
    assert "audio     16,000 Hz, 1 channel, int16;" in capsys.readouterr().out


def test_float32_clips_are_the_decoded_resampled_frames_bit_for_bit(audio_raw, tmp_path):
    """Stereo float32: soxr's output as it is (mono, mixed to int16, is the fixture's)."""
    channels = 2
    out = tmp_path / "out"
    assert main(["build", str(audio_raw), str(out), "--sample-rate", "22050", "--dtype", "float32",
                 "--channels", str(channels), "--max-seconds", "30", "-q"]) == 0
    ds = MMapDataset(out)
    assert load_manifest(out).audio == {"sample_rate": 22050, "channels": channels, "dtype": "<f4"}
    stereo = 0
    for i in range(len(ds)):
        sample = ds[i]
        want = reference(audio_raw / sample["key"], 22050, channels, "float32")
        assert np.array_equal(sample["audio"].numpy(), want), sample["key"]
        stereo += not np.array_equal(want[:, 0], want[:, 1])
    assert stereo  # real stereo files kept both channels (a mono one: copied to both)


@pytest.fixture(scope="module")
def mp3_raw(tmp_path_factory) -> Path:
    """20 Common Voice-like MP3s of the ALSA voices, each longer than two of the packer's blocks."""
    raw = tmp_path_factory.mktemp("mp3") / "raw"
    sounds.mp3_clips(raw, 20, seed=0)
    return raw


def test_mp3s_are_decoded_without_seams_at_block_ends(mp3_raw, tmp_path):
    """Each packed MP3 is within one int16 step of soundfile's whole decode resampled by soxr
    (read a block at a time through SoundFile.read, 6 of these 20 held a jump of up to 14,449
    steps at 16 kHz, 0.44 of full scale, right after a block's end)."""
    from packer.builder.audio import BLOCK_FRAMES

    files = sorted(mp3_raw.iterdir())
    assert len(files) == 20 and all(sf.info(p).frames > 2 * BLOCK_FRAMES for p in files)
    assert {sf.info(p).samplerate for p in files} == {24000, 48000} and {sf.info(p).channels for p in files} == {1, 2}
    out = tmp_path / "out"
    assert main(["build", str(mp3_raw), str(out), "--sample-rate", "16000", "-q"]) == 0
    ds = MMapDataset(out)
    assert len(ds) == 20
    for sample in ds:
        want, got = reference(mp3_raw / sample["key"], 16000), sample["audio"].numpy()
        assert got.shape == want.shape and np.abs(got.astype(np.int32) - want).max() <= 1, sample["key"]


def test_float32_clips_lie_in_minus_one_to_one_with_nan_as_zero_and_are_counted(tmp_path):
    """A float WAV holding NaN, +-Inf and a voice at 4x full scale: stored float32 lies in [-1, 1)
    (NaN as 0, Inf as full scale, before the resampler spreads them), int16 likewise, and the
    manifest counts the values changed (`build.audio_clipped`)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    voice, rate = sf.read(sounds.speech()[0], dtype="float32")
    loud = voice * 4
    loud[[100, 5000, 20000]], loud[[300, 40000]], loud[7000] = np.nan, np.inf, -np.inf
    sf.write(raw / "loud.wav", loud, rate, subtype="FLOAT")
    sf.write(raw / "quiet.wav", voice / 4, rate, subtype="FLOAT")
    for dtype in ("float32", "int16"):
        out = tmp_path / dtype
        assert main(["build", str(raw), str(out), "--sample-rate", "16000", "--dtype", dtype, "-q"]) == 0
        m, ds = load_manifest(out), MMapDataset(out)
        for sample in ds:
            got, want = sample["audio"].numpy(), reference(raw / sample["key"], 16000, dtype=dtype)
            assert np.array_equal(got, want), (dtype, sample["key"])
            if dtype == "float32":
                assert np.isfinite(got).all() and got.min() >= -1 and got.max() < 1
        clean = soxr.resample(np.nan_to_num(loud, nan=0.0, posinf=1.0, neginf=-1.0), rate, 16000, quality="HQ")
        values, (lo, hi) = (np.rint(clean * 32768.0), (-32768, 32767)) if dtype == "int16" else (clean, (-1, FLOAT_TOP))
        over = np.count_nonzero(values < lo) + np.count_nonzero(values > hi)
        assert over > 100 and m.build["audio_clipped"] == 6 + over, dtype  # the 6 NaN and Inf, then the voice's peaks


def test_a_long_clip_costs_a_worker_its_stored_bytes_not_its_decoded_copies(tmp_path):
    """The peak RSS of the build's worker grows by about the stored clip from a 1-minute to a
    4-minute clip (48 kHz FLAC stored as 16 kHz int16: 5.8 MB more), not by the float32 source
    and its resampled copies (67 MB more, read whole)."""
    code = ("import packer._one_blas_thread, resource, sys; from packer.builder.pool import start_method; "
            "from packer.cli import main; assert start_method(False) == 'fork'; rc = main(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")
    peak = {}
    for seconds in (60, 240):  # a forked worker, reaped by the build: RUSAGE_CHILDREN holds its peak
        raw = tmp_path / f"raw{seconds}"
        raw.mkdir()
        sounds.long_clip(raw / "talk.flac", seconds)
        res = subprocess.run([sys.executable, "-c", code, "build", str(raw), str(tmp_path / f"out{seconds}"),
                              "--sample-rate", "16000", "--workers", "1", "-q"], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        assert res.returncode == 0, res.stderr
        peak[seconds] = int(res.stdout.split()[-1]) * 1024
    stored = (240 - 60) * 16000 * 2
    assert peak[240] - peak[60] < 2.5 * stored, f"{(peak[240] - peak[60]) / 1e6:.1f} MB for {stored / 1e6:.1f} MB stored"


def _flac_claiming(path: Path, frames: int) -> None:
    """Patch a FLAC's STREAMINFO total-samples field (its last 36 bits before the MD5)."""
    raw = bytearray(path.read_bytes())
    assert raw[:4] == b"fLaC"
    field = int.from_bytes(raw[18:26], "big")
    raw[18:26] = ((field & ~((1 << 36) - 1)) | frames).to_bytes(8, "big")
    path.write_bytes(bytes(raw))


def test_hostile_files_are_skips_with_reasons_in_bounded_memory(tmp_path):
    """Each hostile file a skip naming what is wrong; a FLAC whose header claims 2**36 frames
    (soundfile.read would allocate 128 GiB for it) is read a block at a time, in a process whose
    address space is capped at 2 GiB."""
    raw = tmp_path / "raw"
    raw.mkdir()
    made = sounds.hostile_audio(raw)
    speech = sounds.speech()
    (raw / "real.wav").write_bytes(speech[0].read_bytes())
    data, rate = sf.read(speech[1], dtype="int16")
    sf.write(raw / "claims_2_36.flac", data, rate, format="FLAC")
    _flac_claiming(raw / "claims_2_36.flac", (1 << 36) - 1)
    out = tmp_path / "out"
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
            "from packer.cli import main; sys.exit(main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", code, "build", str(raw), str(out), "--sample-rate", "16000",
                          "--channels", "2", "--workers", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "mpg123" not in res.stderr and "Note:" not in res.stderr, res.stderr
    m = load_manifest(out)
    reasons = {s.key: s.reason for s in m.skipped}
    assert reasons.keys() == {"truncated.flac", "garbage.mp3", "eight_channels.wav", "empty.wav", "not_audio.ogg",
                              "one_frame.wav", "claims_2_36.flac", "claims_2g_frames.wav"}, reasons
    assert "damaged or truncated" in reasons["truncated.flac"]
    assert "format not recognised" in reasons["garbage.mp3"] and "format not recognised" in reasons["not_audio.ogg"]
    assert "8 channels cannot be mixed down to 2" in reasons["eight_channels.wav"]
    assert "no audio (0 frames)" in reasons["empty.wav"]
    assert "resample to none" in reasons["one_frame.wav"]
    assert "damaged or truncated" in reasons["claims_2_36.flac"]
    assert "header says 4,294,967,280 bytes of data, the file holds 9,600" in reasons["claims_2g_frames.wav"]
    assert m.counts["found"] == len(made) + 2 == m.counts["packed"] + m.counts["skipped"]
    ds = MMapDataset(out)
    assert [ds[i]["key"] for i in range(len(ds))] == ["real.wav"] and ds[0]["audio"].shape[1] == 2


def test_files_cut_short_are_skips_not_shorter_clips(tmp_path):
    """A WAV (its data chunk says more than the file holds) and an Ogg Vorbis file (its last page
    does not end the stream) cut to a third are skips; whole, they are packed. An MP3 carries no
    length to check: cut short, it is packed as what it decodes to (FORMAT-free, said in usage.md)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for src in (sounds.speech()[0], sounds.effects()[0], next(p for p in sounds.music() if p.suffix == ".ogg")):
        data = src.read_bytes()
        (raw / f"whole-{src.name}").write_bytes(data)
        (raw / f"cut-{src.name}").write_bytes(data[: len(data) // 3])
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), "--sample-rate", "16000", "-q"]) == 0
    m = load_manifest(out)
    reasons = {s.key: s.reason for s in m.skipped}
    assert set(reasons) == {p.name for p in raw.iterdir() if p.name.startswith("cut-")}, reasons
    assert all(r.startswith("truncated: ") for r in reasons.values())
    assert m.counts["packed"] == 3


def test_a_clip_over_max_seconds_is_a_skip_and_one_frame_at_the_rate_is_kept(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for p in sounds.music():
        (raw / p.name).write_bytes(p.read_bytes())
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), "--sample-rate", "11025", "--max-seconds", "5", "-q"]) == 0
    reasons = {s.key: s.reason for s in load_manifest(out).skipped}
    assert set(reasons) == {"house_lo.mp3", "house_lo.ogg", "house_lo.wav"}  # 7.1 s of music each
    assert all("longer than --max-seconds 5 (7." in r for r in reasons.values())  # the clip's own length
    for i, sample in enumerate(MMapDataset(out)):  # at the files' own rate: no resampling, the frames as decoded
        want = reference(raw / sample["key"], 11025)
        assert np.array_equal(sample["audio"].numpy(), want), sample["key"]


def test_sidecar_transcripts_are_tokenized_beside_the_audio(tmp_path, minilm, capsys):
    from tokenizers import Tokenizer

    raw = sounds.make_audio_folders(tmp_path / "raw", 20, seed=3, transcripts=True)
    (raw / "speech" / "orphan.txt").write_text("a transcript with no audio\n")
    extra = sounds.effects()[-1]
    (raw / "speech" / f"untold{extra.suffix}").write_bytes(extra.read_bytes())
    out = tmp_path / "out"
    err = one_line_error(capsys, ["build", str(raw), str(out), "--sample-rate", "16000"])
    assert "--tokenizer" in err and "--no-text" in err and "transcripts" in err
    assert main(["build", str(raw), str(out), "--sample-rate", "16000", "--tokenizer", str(minilm), "-q"]) == 0
    m = load_manifest(out)
    assert [c.name for c in m.columns] == ["audio", "tokens", "key"] and m.classes is None
    reasons = {s.key: s.reason for s in m.skipped}
    assert reasons == {"speech/orphan.txt": "a transcript without its audio",
                       f"speech/untold{extra.suffix}": "audio without a transcript (a <stem>.txt beside it)"}
    tok = Tokenizer.from_file(str(minilm))
    tok.no_truncation()
    tok.no_padding()
    ds = MMapDataset(out)
    assert len(ds) == 20
    for sample in ds:
        text = (raw / sample["key"]).with_suffix(".txt").read_text().strip()
        assert sample["tokens"].tolist() == tok.encode(text, add_special_tokens=False).ids
        assert np.abs(sample["audio"].numpy().astype(np.int32) - reference(raw / sample["key"], 16000)).max() <= 1
    out2 = tmp_path / "out2"  # --no-text: every clip, no transcript needed
    assert main(["build", str(raw), str(out2), "--sample-rate", "16000", "--no-text", "-q"]) == 0
    m2 = load_manifest(out2)
    assert [c.name for c in m2.columns] == ["audio", "key"] and m2.counts["packed"] == 21


def _speech_tree(root: Path) -> list[tuple[str, str]]:
    """(id, text) of the ALSA voices copied under root/wavs/<id>.wav."""
    (root / "wavs").mkdir(parents=True)
    rows = []
    for p in sounds.speech():
        (root / "wavs" / p.name).write_bytes(p.read_bytes())
        rows.append((p.stem, sounds.transcript(p)))
    return rows


def test_ljspeech_metadata_and_common_voice_tables_give_the_transcripts(tmp_path, minilm, capsys):
    lj = tmp_path / "LJSpeech"
    rows = _speech_tree(lj)
    with open(lj / "metadata.csv", "w", encoding="utf-8") as f:  # id|text|normalized, no header, no quoting
        for i, (stem, text) in enumerate(rows[:-1]):
            f.write(f"{stem}|{text.upper()} \"q|{text if i % 2 else ''}\n")
        f.write("missing_clip|no such file|\n")
    out = tmp_path / "lj-out"
    assert main(["build", str(lj), str(out), "--sample-rate", "22050", "--tokenizer", str(minilm), "-q"]) == 0
    m = load_manifest(out)
    reasons = {s.key: s.reason for s in m.skipped}
    assert reasons == {f"metadata.csv:{len(rows)}": "names missing_clip.wav, which RAW does not hold",
                       f"wavs/{rows[-1][0]}.wav": "audio without a transcript (a row of metadata.csv)"}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(minilm))
    tok.no_truncation()
    tok.no_padding()
    texts = {f"wavs/{stem}.wav": (text if i % 2 else f"{text.upper()} \"q") for i, (stem, text) in enumerate(rows[:-1])}
    ds = MMapDataset(out)
    assert {s["key"] for s in ds} == set(texts)
    for sample in ds:  # the normalized text where there is one, else the text
        assert sample["tokens"].tolist() == tok.encode(texts[sample["key"]], add_special_tokens=False).ids

    cv = tmp_path / "cv"
    cv_rows = _speech_tree(cv)
    (cv / "wavs").rename(cv / "clips")
    for split, part in (("train", cv_rows[:5]), ("test", cv_rows[5:])):
        with open(cv / f"{split}.tsv", "w", encoding="utf-8") as f:
            f.write("client_id\tpath\tsentence\tup_votes\n")
            f.writelines(f"c{i}\t{stem}.wav\t{text}\t2\n" for i, (stem, text) in enumerate(part))
    err = one_line_error(capsys, ["build", str(cv), str(tmp_path / "cv-out"), "--sample-rate", "16000",
                                  "--tokenizer", str(minilm)])
    assert "test.tsv" in err and "train.tsv" in err and "--split" in err
    assert main(["build", str(cv), str(tmp_path / "cv-out"), "--sample-rate", "16000", "--tokenizer", str(minilm),
                 "--split", "train", "-q"]) == 0
    m = load_manifest(tmp_path / "cv-out")
    reasons = {s.key: s.reason for s in m.skipped}
    assert m.counts["packed"] == 5 and reasons.pop("test.tsv") == "the transcript table of another split, not --split train"
    assert all(r == "audio without a transcript (a row of train.tsv)" for r in reasons.values()) and len(reasons) == 3


def test_audio_flags_and_missing_pieces_are_one_line_errors(tmp_path, image_raw, audio_raw, capsys, monkeypatch):
    err = one_line_error(capsys, ["build", str(audio_raw), str(tmp_path / "a")])
    assert "--sample-rate HZ is required" in err
    err = one_line_error(capsys, ["build", str(image_raw), str(tmp_path / "b"), "--sample-rate", "16000"])
    assert "--sample-rate" in err and "not audio" in err
    err = one_line_error(capsys, ["build", str(audio_raw), str(tmp_path / "c"), "--sample-rate", "100"])
    assert "out of range" in err
    import packer  # the Python API takes the flags' spellings, and refuses what no flag would take

    from packer.errors import ConfigError
    from packer.builder.config import BuildConfig

    assert BuildConfig(raw=audio_raw, out=tmp_path / "e", sample_rate="16000", channels="2", max_seconds="5")\
        .audio_spec("audio") == packer.builder.audio.AudioSpec(16000, 2, "<i2", 5.0)
    for bad, words in (({"sample_rate": 16000.5}, "not a whole number"), ({"max_seconds": 0}, "more than 0")):
        with pytest.raises(ConfigError, match=words):
            BuildConfig(raw=audio_raw, out=tmp_path / "e", **bad)
    monkeypatch.delattr(sf, "_snd")  # a soundfile without the binding MP3s are read through
    err = one_line_error(capsys, ["build", str(audio_raw), str(tmp_path / "d"), "--sample-rate", "16000"])
    assert "lacks the libsndfile binding" in err
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "soxr", None)  # the audio extra not installed
    err = one_line_error(capsys, ["build", str(audio_raw), str(tmp_path / "d"), "--sample-rate", "16000"])
    assert 'pip install "mmpack[audio]"' in err


def test_audio_files_beside_images_are_said_and_their_transcripts_are_not_text(tmp_path, capsys, image_raw):
    raw = tmp_path / "speech"
    raw.mkdir()
    for i in range(3):
        (raw / f"clip{i}.wav").write_bytes(sounds.speech()[i].read_bytes())
        (raw / f"clip{i}.txt").write_text("front center")
    err = one_line_error(capsys, ["build", str(raw), str(tmp_path / "out"), "--kind", "text"])
    assert "its files are audio" in err and "--kind audio" in err
    mixed = tmp_path / "mixed"
    (mixed / "cat").mkdir(parents=True)
    for i, p in enumerate(sorted((image_raw).rglob("*.png"))[:4]):
        (mixed / "cat" / f"{i}.png").write_bytes(p.read_bytes())
    (mixed / "cat" / "meow.wav").write_bytes(sounds.speech()[0].read_bytes())
    assert main(["build", str(mixed), str(tmp_path / "out2"), "--image-size", "32", "-q"]) == 0
    reasons = {s.key: s.reason for s in load_manifest(tmp_path / "out2").skipped}
    assert "build it apart with --kind audio" in reasons["cat/meow.wav"]


def test_the_manifest_refuses_an_audio_object_that_does_not_fit(built, tmp_path):
    from packer.dataset.format import Manifest
    from packer.errors import ManifestError

    doc = json.loads((built["audio"] / "manifest.json").read_text())
    for bad, words in (({"sample_rate": 0, "channels": 1, "dtype": "<i2"}, "sample_rate"),
                       ({"sample_rate": 16000, "channels": 2, "dtype": "<i2"}, "needs column audio"),
                       ({"sample_rate": 16000, "channels": 1, "dtype": "<f8"}, "dtype"), (None, "audio object")):
        with pytest.raises(ManifestError, match=words):
            Manifest.from_doc({**doc, "audio": bad}, where="m")
    with pytest.raises(ManifestError, match="has no audio object"):
        Manifest.from_doc({**doc, "kind": "images"}, where="m")


def test_append_adds_clips_and_merge_refuses_another_rate(audio_raw, tmp_path, capsys):
    import shutil

    raw = tmp_path / "raw"
    shutil.copytree(audio_raw / "speech", raw / "speech")
    shutil.copytree(audio_raw / "music", raw / "music")
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), "--sample-rate", "16000", "-q"]) == 0
    shutil.copytree(audio_raw / "effects", raw / "effects")
    err = one_line_error(capsys, ["build", str(raw), str(out), "--append"])
    assert "--sample-rate" in err  # an append repeats the flags the samples' bytes depend on
    assert "--allow-new-classes" in one_line_error(capsys, ["build", str(raw), str(out), "--sample-rate", "16000",
                                                            "--append"])  # effects: a class folder the dataset lacks
    assert main(["build", str(raw), str(out), "--sample-rate", "16000", "--append", "--allow-new-classes", "-q"]) == 0
    m = load_manifest(out)
    assert m.classes == ("music", "speech", "effects") and m.counts["packed"] == len(list(audio_raw.rglob("*.*")))
    other = tmp_path / "other"
    assert main(["build", str(raw), str(other), "--sample-rate", "22050", "-q"]) == 0
    err = one_line_error(capsys, ["merge", str(out), str(other), str(tmp_path / "merged")])
    assert "22050" in err and "16000" in err
