"""The JPEG lane (`packer build --store jpeg`, FORMAT.md "JPEG images"): its images are Pillow's
decode of the bytes it stores, sample by sample and batch by batch in the pixel lane's order and
shapes; at quality 90 as close to the pixels as Pillow's own encode of them, in under a quarter of
their bytes; damaged bytes in a shard are our error naming the file and the row, never a crash.
(The resume contract runs on it too: tests/contract.py's "jpeg" readers.)"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bench import data
from loaders import Loader, Mixture, MMapDataset
from packer.cli import main
from packer.dataset import format as fmt
from packer.dataset.reader import load_manifest
from packer.dataset.writer import checksum_file
from packer.errors import ConfigError, IntegrityError, ManifestError


def _stored(out: Path) -> list[tuple[bytes, tuple]]:
    """Each sample's JPEG bytes and stored shape, read from the shard files with numpy alone."""
    got = []
    for shard in load_manifest(out).shards:
        d = out / shard.dir
        values, offsets = np.load(d / "image.npy", mmap_mode="r"), np.load(d / "image.offsets.npy")
        shapes = np.load(d / "image.shapes.npy")
        got += [(values[a:b].tobytes(), tuple(s)) for a, b, s in zip(offsets[:-1], offsets[1:], shapes.tolist())]
    return got


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b) ** 2)
    return 99.0 if mse == 0 else float(10 * np.log10(255**2 / mse))


@pytest.mark.parametrize("lane, pixels", [("jpeg", "images"), ("jpeg_aspect", "aspect")])
def test_the_lanes_images_are_pillows_decode_of_its_bytes_in_every_batch(built, lane, pixels):
    stored = _stored(built[lane])
    want = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b, _ in stored]
    assert [w.shape for w in want] == [s for _, s in stored]
    ds, px = MMapDataset(built[lane]), MMapDataset(built[pixels])
    assert load_manifest(built[lane]).version == "4.2" and load_manifest(built[pixels]).version == "4.0"
    assert len(ds) == len(px) and load_manifest(built[lane]).skipped == load_manifest(built[pixels]).skipped
    for i in range(len(ds)):
        a, b = ds[i], px[i]
        assert a["key"] == b["key"] and a["label"] == b["label"] and a["image"].shape == b["image"].shape
        assert np.array_equal(a["image"].numpy(), want[i])
    for threads in (1, 3):
        pos = 0
        for batch in Loader(ds, 7, shuffle=False, num_threads=threads):
            assert set(batch) == ({"image", "label", "key", "image_size"} if "aspect" in lane else {"image", "label", "key"})
            for j, image in enumerate(batch["image"].numpy()):
                h, w = want[pos].shape[:2]
                assert np.array_equal(image[:h, :w], want[pos]) and not image[h:].any() and not image[:, w:].any()
                pos += 1
        assert pos == len(ds)
    # the order and the batches' other columns are the pixel lane's
    assert [b["key"] for b in Loader(ds, 8, seed=4, columns=["key"])] == \
        [b["key"] for b in Loader(px, 8, seed=4, columns=["key"])]
    # a mixture of JPEG datasets (here the lane twice) decodes each image as its dataset does
    at = {ds[i]["key"]: i for i in range(len(ds))}
    for batch in Loader(Mixture([ds, MMapDataset(built[lane])], [1, 1], num_samples=24), 8, seed=1):
        for j, key in enumerate(batch["key"]):
            h, w = want[at[key]].shape[:2]
            assert np.array_equal(batch["image"][j, :h, :w].numpy(), want[at[key]])


def test_at_quality_90_each_image_is_as_close_as_pillows_own_encode_in_under_a_quarter_of_the_bytes(tmp_path):
    """224 px crops of the sample photos: each within 0.5 dB of the PSNR Pillow's default JPEG
    encode of the pixel lane's image reaches (the lane keeps the chroma whole at quality 90), the
    median at least 40 dB, the dataset at most a quarter of the pixel lane's bytes."""
    raw = data.make_image_folders(tmp_path / "raw", 24, seed=5, min_side=224, max_side=640)
    for lane, more in (("pixels", []), ("jpeg", ["--store", "jpeg:90"])):
        assert main(["build", str(raw), str(tmp_path / lane), "--image-size", "224", *more, "-q"]) == 0
    px, jp = MMapDataset(tmp_path / "pixels"), MMapDataset(tmp_path / "jpeg")
    ours, pillows = [], []
    for i in range(len(px)):
        pixels = px[i]["image"].numpy()
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        pillows.append(_psnr(np.asarray(Image.open(buf)), pixels))
        ours.append(_psnr(jp[i]["image"].numpy(), pixels))
    assert len(ours) == 24 and all(o >= p - 0.5 for o, p in zip(ours, pillows)) and np.median(ours) >= 40

    def size(out):
        return sum(f.size_bytes for s in load_manifest(out).shards for f in s.files)
    assert size(tmp_path / "jpeg") <= size(tmp_path / "pixels") / 4


def _sof(b: bytes) -> int:
    """Where the frame header's height (then width) lies in a baseline or progressive JPEG."""
    at = max(b.find(b"\xff\xc0"), b.find(b"\xff\xc2"))
    assert at > 0
    return at + 5


def _patched(raw: bytes, how: str) -> bytes:
    if how == "cut short":
        return raw[: len(raw) // 2]
    if how == "a torn tail":
        return raw[: len(raw) // 2] + bytes(len(raw) - len(raw) // 2)
    if how == "garbage":
        return np.random.default_rng(0).integers(0, 256, len(raw), dtype=np.uint8).tobytes()
    at = _sof(raw)
    side = (65000).to_bytes(2, "big") if how == "a 65,000 x 65,000 header" else (63).to_bytes(2, "big")
    return raw[:at] + side + side + raw[at + 4:]


def _published(out: Path, *files: Path) -> None:
    """The manifests' sizes and checksums of `files` made to match their damaged bytes: what a
    writer that wrote bad bytes would have published, which only a decode can tell."""
    rels = {f.relative_to(out).as_posix(): f for f in files}
    for manifest in (out / fmt.MANIFEST_NAME, *out.glob("g-*/" + fmt.MANIFEST_NAME)):
        doc = json.loads(manifest.read_text())
        for shard in doc["shards"]:
            for entry in shard["files"]:
                if entry["path"] in rels:
                    entry["size_bytes"] = rels[entry["path"]].stat().st_size
                    entry["checksum"]["hex"] = checksum_file(rels[entry["path"]], entry["checksum"]["algo"])
        manifest.write_text(json.dumps(doc))


@pytest.mark.parametrize("how", ["cut short", "a torn tail", "garbage", "a 65,000 x 65,000 header", "another size"])
def test_damaged_jpeg_bytes_in_a_shard_are_our_error_naming_the_file_and_row(built, tmp_path, capsys, how):
    out = tmp_path / "d"
    shutil.copytree(built["jpeg"], out)
    shard = load_manifest(out).shards[1]
    values, offsets_file = out / shard.dir / "image.npy", out / shard.dir / "image.offsets.npy"
    offsets = np.load(offsets_file)
    row = 3
    a, b = 128 + int(offsets[row]), 128 + int(offsets[row + 1])
    blob = values.read_bytes()
    damaged = _patched(blob[a:b], how)
    if len(damaged) != b - a:  # a sample cut short: the offsets after it and the file's header follow
        offsets[row + 1:] -= b - a - len(damaged)
        offsets_file.write_bytes(fmt.npy_header("<i8", offsets.shape) + offsets.astype("<i8").tobytes())
        blob = fmt.npy_header("|u1", (int(offsets[-1]),)) + blob[128:]
    values.write_bytes(blob[:a] + damaged + blob[b:])
    _published(out, values, offsets_file)
    said = rf"{values}: row {row}: its JPEG (header says|bytes do not decode)"
    ds = MMapDataset(out)
    first = load_manifest(out).shards[0].num_samples
    with pytest.raises(IntegrityError, match=said):
        ds[first + row]
    for threads in (1, 2):
        with pytest.raises(IntegrityError, match=said):
            for _ in Loader(ds, 8, shuffle=False, num_threads=threads):
                pass
    assert [k for k in (ds[i]["key"] for i in range(first + row))]  # the samples before it read as before
    assert main(["verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"row {row}" in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("dtype, shape", [("|u1", (64, 64)), ("|u1", (None, 64, 3)), ("<u2", (64, 64, 3)),
                                          ("|u1", (64, 64, 1)), ("|u1", (None,))])
def test_a_jpeg_column_is_rgb_images_or_the_manifest_is_refused(dtype, shape):
    with pytest.raises(ManifestError, match="a jpeg column is"):
        fmt.Column("image", dtype, shape, encoding="jpeg")
    assert fmt.Column("image", "|u1", (None, None, 3), encoding="jpeg").ragged


def test_store_is_refused_where_it_cannot_hold_and_a_mixture_or_append_of_lanes_is_refused(
        built, text_raw, image_raw, minilm, tmp_path, capsys):
    for argv, says in ((["--tokenizer", str(minilm), "--store", "jpeg"], "holds text"),
                       (["--store", "jpg"], "is not 'pixels', 'jpeg' or 'jpeg:QUALITY'"),
                       (["--store", "jpeg:"], "is not 'pixels', 'jpeg' or 'jpeg:QUALITY'"),
                       (["--store", "jpeg:0"], "QUALITY 1..100")):
        raw = text_raw if "--tokenizer" in argv else image_raw
        assert main(["build", str(raw), str(tmp_path / "o"), *argv, "-q"]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    with pytest.raises(ConfigError, match=r"differ from .*jpeg.s image \|u1 \[64, 64, 3\] as JPEG"):
        Loader(Mixture([MMapDataset(built["jpeg"]), MMapDataset(built["images"])], [1, 1]), 8)
    raw, out = tmp_path / "raw", tmp_path / "lane"  # an append says which --store the dataset takes
    (raw / "a").mkdir(parents=True)
    photos = sorted((image_raw / "astronaut").iterdir())[:3]
    shutil.copy(photos[0], raw / "a" / photos[0].name)
    assert main(["build", str(raw), str(out), "--image-size", "32", "--store", "jpeg", "-q"]) == 0
    shutil.copy(photos[1], raw / "a" / photos[1].name)
    assert main(["build", str(raw), str(out), "--image-size", "32", "--append", "-q"]) == 2
    err = capsys.readouterr().err
    assert "store is 'pixels', the dataset was built with 'jpeg:90'; pass --store jpeg:90" in err, err
    assert main(["build", str(raw), str(out), "--image-size", "32", "--append", "--store", "jpeg", "-q"]) == 0
    assert len(MMapDataset(out)) == 2 and load_manifest(out).version == "4.2"


def _pillow_decode(pieces, device):
    """torchvision's decode_jpeg on a list, as `loaders.device_decode` calls it (a list of
    [3, h, w] uint8 tensors on `device`, RuntimeError on bad bytes), done by Pillow."""
    out = []
    for piece in pieces:
        try:
            with Image.open(io.BytesIO(piece.numpy().tobytes())) as img:
                pixels = np.asarray(img.convert("RGB"))
        except Exception as exc:  # noqa: BLE001 - as torchvision raises
            raise RuntimeError(str(exc)) from None
        out.append(torch.from_numpy(pixels.copy()).permute(2, 0, 1).to(device))
    return out


@pytest.mark.parametrize("lane", ["jpeg", "jpeg_aspect"])
def test_a_decode_after_the_copy_stage_gives_the_batches_the_threads_give(built, monkeypatch, lane):
    """jpeg_decode="device": the gather hands each batch's bytes and one call after the copy
    stage decodes them (torchvision's nvJPEG on a GPU; stood in for here by Pillow through the
    same call): the batches, canvas and sizes too, are the threads' batches."""
    from loaders import device_decode

    monkeypatch.setattr(device_decode, "decoder", lambda: _pillow_decode)
    ds = MMapDataset(built[lane])
    for threads in (1, 2):
        on_device = list(Loader(ds, 7, seed=2, num_threads=threads, jpeg_decode="device"))
        by_threads = list(Loader(ds, 7, seed=2, num_threads=threads, jpeg_decode="threads"))
        assert len(on_device) == len(by_threads) > 1
        for a, b in zip(on_device, by_threads):
            assert set(a) == set(b) and a["key"] == b["key"] and torch.equal(a["label"], b["label"])
            assert torch.equal(a["image"], b["image"]) and a["image"].is_contiguous()
            assert "image_size" not in b or torch.equal(a["image_size"], b["image_size"])


def test_a_device_decode_names_the_sample_it_fails_on_and_is_refused_without_torchvision(built, monkeypatch):
    from loaders import device_decode
    from loaders.batch.decode import JpegBatch

    stored = _stored(built["jpeg"])[:3]
    data = torch.from_numpy(np.frombuffer(b"".join(b for b, _ in stored), np.uint8).copy())
    offsets = np.cumsum([0] + [len(b) for b, _ in stored]).tolist()
    batch = JpegBatch("image", data, offsets, np.array([s for _, s in stored]), True, ["a: row 0", "b: row 1", "c: row 2"])

    def fails_on_the_second(pieces, device):
        if any(torch.equal(p, data[offsets[1]:offsets[2]]) for p in pieces):
            raise RuntimeError("nvjpeg: bad bytes")
        return _pillow_decode(pieces, device)
    with pytest.raises(IntegrityError, match=r"^b: row 1: its JPEG bytes do not decode on cpu \(nvjpeg: bad bytes\)"):
        device_decode.decode_batch(batch, torch.device("cpu"), fails_on_the_second)
    assert device_decode.decode_batch(batch, torch.device("cpu"), _pillow_decode)["image"].shape == (3, 64, 64, 3)
    monkeypatch.setattr(device_decode, "decoder", lambda: None)
    with pytest.raises(ConfigError, match="needs torchvision's decode_jpeg"):
        Loader(MMapDataset(built["jpeg"]), 8, jpeg_decode="device")
    with pytest.raises(ConfigError, match="is not one of auto, threads, device"):
        Loader(MMapDataset(built["jpeg"]), 8, jpeg_decode="gpu")
    assert Loader(MMapDataset(built["jpeg"]), 8, device="cpu")._decode is None  # auto: the threads, off CUDA


def test_auto_decodes_in_the_threads_on_cuda_too_until_the_card_has_been_measured(monkeypatch):
    """"auto" on a CUDA device is the threads' decode (device_decode.AUTO_ON_CUDA) while the
    batched nvJPEG path has not run beside it on a GPU; "device" asks for the card."""
    from loaders import device_decode

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device_decode, "decoder", lambda: _pillow_decode)
    assert device_decode.AUTO_ON_CUDA == "threads"
    assert device_decode.choose("auto", "cuda", encoded=True) is None
    assert device_decode.choose("device", "cuda", encoded=True) is _pillow_decode
    monkeypatch.setattr(device_decode, "AUTO_ON_CUDA", "device")  # the switch, once measured
    assert device_decode.choose("auto", "cuda", encoded=True) is _pillow_decode
    assert device_decode.choose("auto", "cpu", encoded=True) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lane", ["jpeg", "jpeg_aspect"])
def test_nvjpeg_on_the_card_gives_the_threads_batches_within_decoder_rounding(built, lane):
    """The proof "auto" waits for: torchvision's batched decode on the GPU against the Pillow
    decode in the threads, the same samples, shapes, canvas and sizes, and pixels within a
    decoder's rounding (PSNR against the threads' at least 45 dB on every image)."""
    pytest.importorskip("torchvision.io")
    ds = MMapDataset(built[lane])
    on_card = list(Loader(ds, 7, seed=2, device="cuda", jpeg_decode="device"))
    by_threads = list(Loader(ds, 7, seed=2, device="cuda", jpeg_decode="threads"))
    assert len(on_card) == len(by_threads) > 1
    for a, b in zip(on_card, by_threads):
        assert a["key"] == b["key"] and a["image"].shape == b["image"].shape and a["image"].is_cuda
        sizes = b["image_size"].tolist() if "image_size" in b else [tuple(b["image"].shape[1:3])] * len(b["key"])
        if "image_size" in b:
            assert torch.equal(a["image_size"].cpu(), b["image_size"].cpu())
        for i, (h, w) in enumerate(sizes):
            x, y = a["image"][i, :h, :w].cpu().numpy(), b["image"][i, :h, :w].cpu().numpy()
            assert _psnr(x, y) >= 45, (a["key"][i], _psnr(x, y))
