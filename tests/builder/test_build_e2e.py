"""End to end through the real CLI on real photos, hostile images, text and tokenizers."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image, ImageOps
from tokenizers import Tokenizer

from bench.measure import evict
from loaders import MMapDataset
from packer.dataset import format as fmt
from packer.builder import scan as sources
from packer.cli import DISK_BOUND, main
from packer.dataset.reader import load_manifest

from ..conftest import PLANTED_IMAGE_SKIPS, PLANTED_TEXT_SKIPS
from ..trees import IMG, one_line_error


def all_files(raw: Path) -> list[str]:
    return sorted(p.relative_to(raw).as_posix() for p in raw.rglob("*") if p.is_symlink() or p.is_file())


def reference_pixels(path: Path, size: int) -> np.ndarray:
    """An independent Pillow decode + resize: no draft mode, plain convert("RGB")."""
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img).convert("RGB")
        w, h = img.size
        s = size / min(w, h)
        nw, nh = max(size, round(w * s)), max(size, round(h * s))
        img = img.resize((nw, nh), Image.Resampling.BILINEAR)
        left, top = (nw - size) // 2, (nh - size) // 2
        return np.asarray(img.crop((left, top, left + size, top + size)))


def _mode(path: Path) -> str:
    with Image.open(path) as img:
        return img.mode


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


JPEG_DRAFT_MIN_PSNR = 30.0  # dB: draft (DCT-scaled) decode vs full decode, both resized to S


def test_images_counts_add_up_and_skips_are_the_planted_files(built, image_raw):
    m = load_manifest(built["images"])
    files = all_files(image_raw)
    assert m.counts["found"] == len(files) == m.counts["packed"] + m.counts["skipped"]
    assert {s.key for s in m.skipped} == PLANTED_IMAGE_SKIPS
    assert m.classes == tuple(sorted(p.name for p in image_raw.iterdir() if p.is_dir()))
    # planned 16 records a shard, before decoding: decode skips make a shard smaller, never larger
    assert all(0 < s.num_samples <= 16 for s in m.shards) and len(m.shards) >= math.ceil(m.num_samples / 16)


def test_image_pixels_labels_and_keys(built, image_raw):
    ds = MMapDataset(built["images"])
    assert ds.columns["image"].shape == (64, 64, 3)
    checked_exact = checked_jpeg = 0
    for i in range(len(ds)):
        sample = ds[i]
        path = image_raw / sample["key"]
        assert path.is_file()
        assert ds.classes[int(sample["label"])] == sample["key"].split("/")[0]
        got = sample["image"].numpy()
        if path.suffix.lower() in (".jpg", ".jpeg"):
            assert psnr(got, reference_pixels(path, 64)) >= JPEG_DRAFT_MIN_PSNR, path
            checked_jpeg += 1
        elif _mode(path) not in ("I;16", "I;16B", "I", "F") and "16bit" not in path.name:
            np.testing.assert_array_equal(got, reference_pixels(path, 64), err_msg=str(path))
            checked_exact += 1
    assert checked_exact > 20 and checked_jpeg > 5
    # ImageFolder's class_to_idx and targets (here an int64 array): what num_classes, class
    # weights and saved checkpoints read
    assert ds.class_to_idx == {name: i for i, name in enumerate(sorted(p.name for p in image_raw.iterdir()
                                                                           if p.is_dir()))}
    assert ds.targets.dtype == np.int64 and ds.targets.tolist() == [int(ds[i]["label"]) for i in range(len(ds))]


def test_sixteen_bit_images_are_rescaled_by_their_real_depth_not_clipped(built):
    ds = MMapDataset(built["images"])
    by_key = {ds[i]["key"]: i for i in range(len(ds))}
    img = ds[by_key["hostile/16bit.cropped.tif"]]["image"].numpy()
    raw16 = np.asarray(Image.open(Path(ds.manifest.build["raw"]) / "hostile/16bit.cropped.tif"), dtype=np.int64)
    assert Image.open(Path(ds.manifest.build["raw"]) / "hostile/16bit.cropped.tif").convert("RGB").getextrema()[0][0] == 255
    assert img.max() < 255  # plain convert("RGB") gives an all-white image here
    assert 512 <= raw16.max() < 1024  # a dark 16-bit image: its values use 10 bits
    assert abs(float(img.mean()) - float(raw16.mean()) * 255 / 1023) < 1.0  # (a 65535 scale: a mean of 1.7)


def test_twelve_bit_data_keeps_its_picture_in_a_12_or_a_16_bit_file():
    """Pillow's 12-bit TIFF and the same pixels in a 16-bit TIFF: the same bytes, not black."""
    from bench import data
    from packer.builder.images import decode_image

    a = decode_image(data.fetch(data.PILLOW_EXTRA) / "12bit.cropped.tif", None)
    b = decode_image(data.fetch(data.PILLOW_TESTS) / "12in16bit.tif", None)
    raw = np.asarray(Image.open(data.fetch(data.PILLOW_TESTS) / "12in16bit.tif"), dtype=np.int64)
    assert np.array_equal(a, b) and len(np.unique(a)) > 10  # a 65535 (or 4095) scale: 1-3 levels
    assert np.array_equal(a[..., 0], raw)  # values under 256 are 8-bit data: kept as they are


def test_exif_orientation_is_applied(built):
    ds = MMapDataset(built["images"])
    by_key = {ds[i]["key"]: ds[i]["image"].numpy() for i in range(len(ds)) if "hopper" in ds[i]["key"]}
    upright = by_key["hostile/hopper.jpg"]
    for n in range(2, 9):
        rotated = by_key[f"hostile/hopper_orientation_{n}.jpg"]
        assert psnr(rotated, upright) > 20, n  # un-transposed they differ wildly (< 12 dB)


def test_text_tokens_equal_tokenizer_encode(built, text_raw, minilm):
    tok = Tokenizer.from_file(str(minilm))
    tok.no_truncation()
    tok.no_padding()
    ds = MMapDataset(built["text"])
    m = ds.manifest
    assert m.column("tokens").dtype == "<u2"
    eos = m.tokenizer["eos_id"]
    assert eos == tok.token_to_id("[SEP]")
    longest = 0
    for i in range(len(ds)):
        sample = ds[i]
        key = sample["key"]
        if ":" in key:
            name, where = key.rsplit(":", 1)
            if name.endswith(".jsonl"):
                text = json.loads((text_raw / name).read_text(encoding="utf-8").splitlines()[int(where) - 1])["text"]
            else:
                import pyarrow.parquet as pq

                text = pq.read_table(text_raw / name).column("text")[int(where)].as_py()
        else:
            text = (text_raw / key).read_text(encoding="utf-8")
        want = tok.encode(text, add_special_tokens=False).ids + [eos]
        got = sample["tokens"]
        assert got.dtype == __import__("torch").int64  # stored as <u2 (above), handed over as int64
        assert got.long().tolist() == want, key
        longest = max(longest, len(want))
    assert longest > 128  # the tokenizer.json truncates to 128: the packer must not


def test_text_counts_and_skips(built, text_raw):
    m = load_manifest(built["text"])
    assert PLANTED_TEXT_SKIPS <= {s.key for s in m.skipped}
    assert m.counts["found"] == m.counts["packed"] + m.counts["skipped"]
    import pyarrow.parquet as pq

    docs = len(list((text_raw / "txt").iterdir())) + pq.ParquetFile(text_raw / "docs.parquet").metadata.num_rows
    for name in ("docs.jsonl", "bad.jsonl"):
        with open(text_raw / name, "rb") as f:
            docs += sum(1 for _ in f)
    assert m.counts["found"] == docs + 1  # + README.md
    assert len(m.shards) > 1


def test_uint32_tokens_with_a_large_vocabulary(tmp_path, text_raw, big_tokenizer):
    out = tmp_path / "out"
    assert main(["build", str(text_raw), str(out), "--tokenizer", str(big_tokenizer), "-q"]) == 0
    ds = MMapDataset(out)
    assert ds.manifest.column("tokens").dtype == "<u4"
    tok = Tokenizer.from_file(str(big_tokenizer))
    seen_big = False
    compared = 0
    for i in range(len(ds)):
        s = ds[i]
        seen_big |= int(s["tokens"].long().max()) > 65535
        if s["key"].startswith("txt/"):
            want = tok.encode((text_raw / s["key"]).read_text(encoding="utf-8"), add_special_tokens=False).ids
            assert s["tokens"].long().tolist() == want
            compared += 1
    assert seen_big and compared >= 3


def test_pairs_captions_and_images(built, pairs_raw, minilm):
    tok = Tokenizer.from_file(str(minilm))
    tok.no_padding()  # the shipped tokenizer.json pads every caption to 128 ids
    ds = MMapDataset(built["pairs"])
    m = ds.manifest
    assert {s.key for s in m.skipped} == {"000/orphan.txt", "000/lonely.png"}
    assert m.counts["found"] == m.counts["packed"] + 2
    for i in range(len(ds)):
        s = ds[i]
        stem = (pairs_raw / s["key"]).with_suffix("")
        cap = stem.with_suffix(".txt")
        caption = cap.read_text().strip() if cap.exists() else json.loads(stem.with_suffix(".json").read_text())["caption"]
        assert s["tokens"].long().tolist() == tok.encode(caption, add_special_tokens=False).ids
        assert s["image"].shape == (32, 32, 3)


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data")  # the reference decode below, of a hostile file
def test_keep_size_stores_each_image_at_its_own_size(tmp_path, image_raw):
    out = tmp_path / "keep"
    assert main(["build", str(image_raw), str(out), "--image-size", "keep", "-q"]) == 0
    ds = MMapDataset(out)
    assert ds.columns["image"].ragged
    shapes = set()
    for i in range(0, len(ds), 3):
        s = ds[i]
        path = image_raw / s["key"]
        if path.suffix.lower() in (".png", ".webp", ".gif") and "16" not in path.name:
            with Image.open(path) as img:
                ref = np.asarray(ImageOps.exif_transpose(img).convert("RGB"))
            np.testing.assert_array_equal(s["image"].numpy(), ref)
        shapes.add(tuple(s["image"].shape))
    assert len(shapes) > 5


def test_user_mistakes_get_one_line_errors(tmp_path, capsys, text_raw, image_raw):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "empty RAW" in one_line_error(capsys, ["build", str(empty), str(tmp_path / "o1")])
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "a.csv").write_text("x\n")
    assert "no recognisable layout" in one_line_error(capsys, ["build", str(odd), str(tmp_path / "o2")])
    assert "--tokenizer" in one_line_error(capsys, ["build", str(text_raw), str(tmp_path / "o3")])
    assert "tokenizer file not found" in one_line_error(
        capsys, ["build", str(text_raw), str(tmp_path / "o4"), "--tokenizer", str(tmp_path / "nope.json")])
    assert "not a directory" in one_line_error(capsys, ["build", str(tmp_path / "missing"), str(tmp_path / "o5")])
    assert "--image-size" in one_line_error(capsys, ["build", str(image_raw), str(tmp_path / "o6"), "--image-size", "big"])
    assert "--shard-size" in one_line_error(capsys, ["build", str(image_raw), str(tmp_path / "o7"), "--shard-size", "lots"])
    for name in ("o1", "o2", "o3", "o4", "o5", "o6", "o7"):
        assert not (tmp_path / name).exists()


def test_existing_out_needs_overwrite(tmp_path, capsys, image_raw):
    out = tmp_path / "out"
    assert main(["build", str(image_raw), str(out), "--image-size", "16", "-q"]) == 0
    assert "--overwrite" in one_line_error(capsys, ["build", str(image_raw), str(out)])
    assert main(["build", str(image_raw), str(out), "--image-size", "8", "--overwrite", "-q"]) == 0
    assert MMapDataset(out)[0]["image"].shape == (8, 8, 3)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("x")
    assert "refusing" in one_line_error(capsys, ["build", str(image_raw), str(foreign), "--overwrite"])


def test_strict_fails_on_any_skip(tmp_path, capsys, image_raw):
    out = tmp_path / "strict"
    err = one_line_error(capsys, ["build", str(image_raw), str(out), "--strict"])
    assert "--strict" in err
    assert not (out / fmt.MANIFEST_NAME).exists()


def test_build_summary_says_counts(tmp_path, capsys, pairs_raw, minilm):
    assert main(["build", str(pairs_raw), str(tmp_path / "o"), "--tokenizer", str(minilm)]) == 0
    out = capsys.readouterr().out
    assert "found 42 = packed 40 + skipped 2" in out
    assert "skipped 000/orphan.txt: caption without an image" in out


@pytest.mark.parametrize("layout", ["images", "text"])
def test_a_build_on_a_slow_disk_says_the_workers_waited_on_it(tmp_path, image_raw, text_raw, minilm, layout):
    """Every process of the build (the pool's workers too) gets an fsync that takes 0.3 s, as a
    slow disk's would: the summary line says what share of the workers' time went waiting on
    it, and the manifest keeps it. The data comes out as it would on a fast disk."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import os, time\n_fsync = os.fsync\n"
        "def fsync(fd):\n    time.sleep(0.3)\n    _fsync(fd)\nos.fsync = fsync\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])])}
    raw, extra = (image_raw, ["--image-size", "32"]) if layout == "images" else (text_raw, ["--tokenizer", str(minilm)])
    res = subprocess.run([sys.executable, "-m", "packer", "build", str(raw), str(tmp_path / "o"), "--workers", "2",
                          *extra], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    waited = json.loads((tmp_path / "o" / "manifest.json").read_text())["build"]["disk_wait"]
    # a build of a second or two with 0.3 s fsyncs waits on them a large share on any machine; on
    # a loaded one its decoding takes longer, so the share is bounded loosely and the line is
    # checked against it
    assert 0.1 < waited <= 1, waited
    summary = res.stdout.strip().splitlines()[-1]
    said = f"the workers spent {100 * waited:.0f}% of their time waiting on the disk"
    assert (said in summary) == (waited >= DISK_BOUND), summary


def test_a_workers_last_progress_is_counted_when_it_arrives_after_its_result(tmp_path, text_raw, minilm):
    """A worker sends its progress (items done, seconds waited on the disk) through a queue's
    feeder thread, its result through the pool's own pipe: the progress can come second, most
    often on a loaded machine. Here the feeder threads of the pool's workers wait 1 s before
    each write, so it always does: the build still counts the disk wait it carries (it read 0
    when its last drain came before the message)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import os, time, threading, multiprocessing, multiprocessing.connection as c\n"
        "_fsync, _send = os.fsync, c.Connection.send_bytes\n"
        "def fsync(fd):\n    time.sleep(0.2)\n    _fsync(fd)\n"
        "def send_bytes(self, *a, **k):\n"
        "    if multiprocessing.current_process().name != 'MainProcess' and \\\n"
        "            threading.current_thread() is not threading.main_thread():\n"
        "        time.sleep(1)\n"
        "    return _send(self, *a, **k)\n"
        "os.fsync, c.Connection.send_bytes = fsync, send_bytes\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])])}
    res = subprocess.run([sys.executable, "-m", "packer", "build", str(text_raw), str(tmp_path / "o"), "--workers", "1",
                          "--tokenizer", str(minilm)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["build"]["disk_wait"] > 0.1, res.stdout


def test_console_scripts_are_installed(tmp_path, built):
    res = subprocess.run(["packer", "info", str(built["images"]), "--json"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["kind"] == "images" and info["counts"]["found"] == info["counts"]["packed"] + info["counts"]["skipped"]
    res = subprocess.run(["packer", "info", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 2 and "not an mmpack dataset" in res.stderr and "Traceback" not in res.stderr


def test_mmapdataset_samples_are_the_callers_copies_and_quiet(built):
    ds = MMapDataset(built["images"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = ds[3]
    shard, row = ds.reader.locate(3)
    arrays = ds.reader.column(shard, "image")
    assert np.array_equal(s["image"].numpy(), arrays.values[row])
    assert not np.shares_memory(s["image"].numpy(), arrays.values) and s["image"].numpy().flags.writeable
    assert s["label"].dtype == __import__("torch").int64 and s["label"].dim() == 0
    assert ds[-1]["key"] == ds[len(ds) - 1]["key"]
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(IndexError, match=f"sample {-len(ds) - 1} out of range"):  # the index given, as asked
        ds[-len(ds) - 1]


def test_decompression_bomb_warning_is_an_error_for_that_file(tmp_path, monkeypatch):
    """Between 1x and 2x Pillow's pixel limit Pillow only warns; the packer skips the file."""
    from bench import data

    raw = tmp_path / "raw"
    (raw / "a").mkdir(parents=True)
    photo = data.fetch(data.SKLEARN) / "china.jpg"  # 640 x 427 = 273,280 pixels
    import shutil

    shutil.copy(photo, raw / "a" / "big.jpg")
    shutil.copy(data.fetch(data.PILLOW_TESTS) / "hopper.png", raw / "a" / "small.png")  # 128 x 128
    # big.jpg is 1.37x the limit set here: the warning range. The limit is set in the command's
    # process, whose pool workers decode with the same limit (forked, or from a forkserver:
    # the build hands it to them)
    code = ("from PIL import Image; Image.MAX_IMAGE_PIXELS = 200_000; import sys, packer.cli; "
            f"sys.exit(packer.cli.main(['build', {str(raw)!r}, {str(tmp_path / 'out')!r}, '--image-size', '32', '-q']))")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    m = load_manifest(tmp_path / "out")
    assert [(s.key, s.stage) for s in m.skipped] == [("a/big.jpg", "decode")]
    assert "decompression bomb" in m.skipped[0].reason and m.counts["packed"] == 1


def test_a_forkservers_workers_decode_with_the_callers_pixel_limit(tmp_path, monkeypatch):
    """A script that sets Pillow's limit and builds from a process with other threads (whose pool
    starts from a forkserver, not a fork): the workers use the limit the script set."""
    from PIL import Image

    from bench import data
    from packer.builder import pool as engines
    from packer.builder.run import BuildConfig, build

    raw = tmp_path / "raw" / "a"
    raw.mkdir(parents=True)
    shutil.copy(data.fetch(data.SKLEARN) / "china.jpg", raw / "big.jpg")  # 273,280 pixels
    shutil.copy(data.fetch(data.PILLOW_TESTS) / "hopper.png", raw / "small.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 200_000)
    other = threading.Event()
    thread = threading.Thread(target=other.wait)  # another thread: the pool cannot fork
    thread.start()
    try:
        assert engines.start_method(tokenizer=False) == "forkserver"
        m = build(BuildConfig(raw.parent, tmp_path / "out", image_size=32, workers=2))
    finally:
        other.set()
        thread.join()
    assert [(s.key, s.stage) for s in m.skipped] == [("a/big.jpg", "decode")] and m.counts["packed"] == 1


def test_scan_lists_every_file_once_and_reports_what_it_cannot_read(tmp_path, monkeypatch):
    """Hidden files, dangling links, FIFOs and unreadable folders are skips; a symlinked folder
    is followed, as ImageFolder follows it, once (a loop is a skip); each file listed carries
    the size and mtime of its one stat (the inputs digest)."""

    raw = tmp_path / "raw"
    for rel in ("a/1.jpg", "a/.hidden.jpg", "b/2.png", "locked/3.jpg"):
        (raw / rel).parent.mkdir(parents=True, exist_ok=True)
        (raw / rel).write_bytes(b"x" * len(rel))
    os.symlink(raw / "gone.jpg", raw / "a" / "dangling.jpg")
    os.symlink(raw / "b", raw / "c")  # a symlinked folder: walked
    os.symlink(raw, raw / "b" / "up")  # a loop
    os.mkfifo(raw / "b" / "pipe.jpg")  # reading it would block the build
    real_scandir = os.scandir

    def scandir(path):
        if os.path.basename(path) == "locked":  # root reads a chmod-000 folder, so fail it here
            raise PermissionError(13, "Permission denied")
        return real_scandir(path)

    monkeypatch.setattr(sources.os, "scandir", scandir)
    files, skipped, stats = sources.list_files(raw)
    assert [rel for rel, _ in files] == ["a/1.jpg", "b/2.png", "c/2.png"]
    loop = "symlink to a folder it is inside (a loop, not followed)"
    assert [(s.key, s.reason) for s in skipped] == [
        ("a/.hidden.jpg", "hidden file"), ("a/dangling.jpg", "dangling symlink"),
        ("b/pipe.jpg", "not a regular file"), ("b/up", loop), ("c/pipe.jpg", "not a regular file"), ("c/up", loop),
        ("locked", "unreadable folder (Permission denied)")]
    st = (raw / "b/2.png").stat()
    assert stats[str(raw / "b/2.png")] == (st.st_size, st.st_mtime_ns) and len(stats) == 3
    monkeypatch.chdir(raw / "b")  # RAW given as "."
    files, _, stats = sources.list_files(Path("."))
    assert [rel for rel, _ in files] == ["2.png", "up/a/1.jpg"] and all(path in stats for _, path in files)


@given(n=st.integers(0, 60), ahead=st.integers(0, 10))
def test_read_ahead_keeps_order_and_prefetches_each_record_ahead_of_its_turn(n, ahead):
    records = [sources.Record(f"r{i}", f"/nowhere/r{i}.jpg") for i in range(n)]
    items = [(i, r) for i, r in enumerate(records)]
    prefetched = []
    with mock.patch.object(sources, "prefetch", lambda rs: prefetched.extend(r.key for r in rs)):
        out = []
        for item in sources.read_ahead(items, lambda it: it[1], ahead):
            i = item[0]
            assert prefetched == [r.key for r in records[:min(n, i + ahead + 1)]]  # its own and `ahead` more
            out.append(item)
    assert out == items


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no RWF_NOWAIT: prefetch always asks")
def test_prefetch_asks_only_when_the_inputs_are_not_cached(tmp_path, monkeypatch):
    """Cached first and last files: no fadvise at all (it would cost more than it saves);
    either one evicted: a WILLNEED for every file."""
    records = []
    for i in range(5):
        (tmp_path / f"{i}.jpg").write_bytes(os.urandom(20000))
        records.append(sources.Record(f"{i}.jpg", str(tmp_path / f"{i}.jpg")))
    asked = []
    monkeypatch.setattr(sources.os, "posix_fadvise", lambda fd, offset, n, advice: asked.append(advice))
    sources.prefetch(records)
    assert asked == []
    monkeypatch.undo()
    canary = tmp_path / "canary.jpg"  # probed here instead of the input: a probe that misses may start readahead
    canary.write_bytes(os.urandom(20000))
    evict([canary])
    if sources._cached(canary):
        pytest.skip(f"{tmp_path}: this file system keeps the page cache (tmpfs?)")
    evict([records[-1].path])
    monkeypatch.setattr(sources.os, "posix_fadvise", lambda fd, offset, n, advice: asked.append(advice))
    sources.prefetch(records)
    assert asked == [os.POSIX_FADV_WILLNEED] * 5


def test_prefetch_leaves_unreadable_inputs_to_the_reader(tmp_path):
    """Missing files, folders, FIFOs (opening one for reading must not block) and big JSONL
    or Parquet files are passed over without an error; the reader reports what it must."""
    (tmp_path / "ok.jpg").write_bytes(b"\xff\xd8" * 100)
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo.png")
    paths = ["ok.jpg", "missing.jpg", "folder", "fifo.png", "big.jsonl", "big.parquet"]
    records = [sources.Record(p, str(tmp_path / p), caption=str(tmp_path / "missing.txt")) for p in paths]
    done = threading.Thread(target=sources.prefetch, args=(records,), daemon=True)
    done.start()
    done.join(timeout=10)
    assert not done.is_alive(), "prefetch blocked (on the FIFO)"


def test_a_flat_folder_packs_as_unlabeled_images_and_the_layout_says_why(tmp_path, capsys):
    from bench import data

    raw = tmp_path / "flat"
    for i, path in enumerate(sorted(data.make_image_folders(tmp_path / "classes", 9, seed=4).glob("*/*"))):
        raw.mkdir(exist_ok=True)
        path.rename(raw / f"{i}{path.suffix}")
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), "--image-size", "16"]) == 0
    assert "layout images: 9 images in one flat folder (no classes, no labels)" in capsys.readouterr().out
    ds = MMapDataset(out)
    assert ds.classes is None and set(ds[0]) == {"image", "key"} and len(ds) == 9
    assert ds.class_to_idx is None and ds.targets is None
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("buy milk\n")
    assert main(["build", str(notes), str(tmp_path / "n")]) == 2
    err = capsys.readouterr().err
    assert "required to pack text" in err and "1 .txt/.jsonl/.parquet files and 0 images" in err and "--kind" in err


def test_background_is_part_of_what_the_bytes_depend_on(tmp_path, image_raw, capsys):
    out = tmp_path / "out"
    assert main(["build", str(image_raw), str(out), "--image-size", "16", "-q", "--background", "255,255,255"]) == 0
    assert load_manifest(out).build["background"] == [255, 255, 255]
    assert main(["build", str(image_raw), str(out), "--image-size", "16", "-q"]) == 2  # another dataset now
    assert main(["build", str(image_raw), str(out), "--image-size", "16", "-q", "--background", "1,2"]) == 2
    assert "--background" in capsys.readouterr().err


def test_cli_edges_say_what_to_do(tmp_path, built, capsys):
    """Skips in `info --json`, the subcommand's usage on a typo, an archive named like a file,
    the columns listed for an unknown one."""
    from loaders import Loader
    from packer.errors import ColumnError

    assert main(["info", str(built["images"]), "--json", "--skipped"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["counts"]["skipped"] == len(doc["skipped"]) > 0 and {"key", "stage", "reason"} <= set(doc["skipped"][0])
    with pytest.raises(SystemExit):
        main(["build", str(built["images"]), str(tmp_path / "o"), "--imagesize", "3"])
    err = capsys.readouterr().err
    assert "usage: packer build" in err and "unrecognized arguments: --imagesize" in err
    assert main(["pack", str(built["images"]), str(tmp_path / "x.tar.zst")]) == 2
    assert "an archive is a directory" in capsys.readouterr().err and not (tmp_path / "x.tar.zst").exists()
    with pytest.raises(ColumnError, match="columns are image, label, key") as caught:
        Loader(MMapDataset(built["images"]), 8, columns=["img"])
    assert isinstance(caught.value, KeyError)
def test_progress_lines_into_a_pipe(tmp_path, image_raw, capsys, monkeypatch):
    from packer import cli

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(cli.ProgressBar, "LINE_EVERY_S", 0.0)
    assert main(["build", str(image_raw), str(tmp_path / "a"), *IMG, "--workers", "2"]) == 0
    err = capsys.readouterr().err
    assert "packing:" in err and "records" in err and "ETA" in err
    assert main(["build", str(image_raw), str(tmp_path / "b"), *IMG, "--quiet"]) == 0
    assert "packing:" not in capsys.readouterr().err
    monkeypatch.setenv("CI", "true")
    assert main(["build", str(image_raw), str(tmp_path / "c"), *IMG]) == 0
    assert "packing:" not in capsys.readouterr().err


def test_an_out_written_as_a_folder_or_under_home_builds_there(tmp_path, image_raw, monkeypatch, capsys):
    """`data/photos/` (the README's spelling), `./data/p`, and `~/...` from Python (no shell to
    expand it): a local dataset dir, never taken for a URL."""
    import packer

    assert main(["build", str(image_raw), str(tmp_path / "slash") + "/", "--image-size", "8", "-q"]) == 0
    assert MMapDataset(tmp_path / "slash")[0]["image"].shape == (8, 8, 3)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "raw").symlink_to(image_raw)
    m = packer.build("~/raw", "~/home-out/", image_size=8, workers=1)
    assert m.num_samples > 0 and (tmp_path / "home-out" / "manifest.json").is_file()
    assert "build" in dir(packer) and "verify" in dir(packer)
