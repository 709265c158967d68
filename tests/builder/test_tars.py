"""Tars and Parquet files as users' pipelines leave them: an empty tar beside a good one, a
gzip-compressed tar named .tar, a member name that is not UTF-8, a pax size of 2**70, a cut
Parquet file alone. Each is a skip or a one-line error naming the file, never a traceback or
the whole build aborted."""

from __future__ import annotations

import gzip
import io
import tarfile

from loaders import MMapDataset
from packer.cli import main

from ..trees import one_line_error
from .test_forms import SIZE, _hf, _samples, _tar, photos  # noqa: F401 - photos: a fixture


def _skips(out):
    m = MMapDataset(out).manifest
    assert m.counts["found"] == m.counts["packed"] + m.counts["skipped"]
    return m, {s.key: s.reason for s in m.skipped}


def test_an_empty_tar_or_a_gzip_tar_beside_a_good_one_is_a_skip(photos, tmp_path, capsys):  # noqa: F811
    raw = _tar(photos, tmp_path / "tar", name="train-000001.tar")
    (raw / "train-000000.tar").write_bytes(b"")  # sorted first: its fields were the build's, and it has none
    packed = _tar(photos, tmp_path / "gz", name="train-000002.tar") / "train-000002.tar"
    (raw / "train-000002.tar").write_bytes(gzip.compress(packed.read_bytes()))
    assert main(["build", str(raw), str(tmp_path / "out"), *SIZE]) == 0
    m, skipped = _skips(tmp_path / "out")
    assert m.counts["packed"] == len(_samples(photos))
    assert skipped["train-000000.tar"] == "not a readable tar (empty file)"
    assert "gzip-compressed tar named .tar" in skipped["train-000002.tar"]
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "x.tar").write_bytes(gzip.compress(packed.read_bytes()))
    err = one_line_error(capsys, ["build", str(alone), str(tmp_path / "o2"), *SIZE])
    assert "x.tar: a gzip-compressed tar named .tar" in err and "decompress it" in err


def test_a_member_name_that_is_not_utf8_and_a_pax_size_of_2_70_are_skips(photos, tmp_path):  # noqa: F811
    """Before: UnicodeEncodeError in the inputs' digest; OverflowError, the whole build aborted."""
    raw = tmp_path / "tar"
    raw.mkdir()
    files = [p for p, _, _ in _samples(photos)][:4]
    with tarfile.open(raw / "a.tar", "w", format=tarfile.GNU_FORMAT, encoding="utf-8",
                      errors="surrogateescape") as t:
        for i, p in enumerate(files):
            stem = f"{i:04d}" + ("\udcff" if i == 1 else "")
            for ext, payload in ((p.suffix, p.read_bytes()), (".cls", b"0")):
                info = tarfile.TarInfo(stem + ext)
                info.size = len(payload)
                t.addfile(info, io.BytesIO(payload))
    with tarfile.open(raw / "b.tar", "w", format=tarfile.PAX_FORMAT) as t:
        payload = files[0].read_bytes()
        info = tarfile.TarInfo("000009" + files[0].suffix)
        info.size, info.pax_headers = len(payload), {"size": str(2 ** 70)}
        t.addfile(info, io.BytesIO(payload))
    assert main(["build", str(raw), str(tmp_path / "out"), *SIZE]) == 0
    m, skipped = _skips(tmp_path / "out")
    assert m.counts["packed"] == 3
    assert skipped[f"a.tar:0001\\xff{files[1].suffix}"].startswith("a member whose name is not UTF-8")
    assert "ends past the end of the tar" in skipped[f"b.tar:000009{files[0].suffix}"]


def test_a_cut_parquet_file_alone_is_named_not_taken_for_text(photos, tmp_path, capsys):  # noqa: F811
    """Before: "--tokenizer is required to pack text" for a cut Hugging Face shard."""
    raw = _hf(photos, tmp_path / "hf")
    path = raw / "data" / "train-00000-of-00001.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    err = one_line_error(capsys, ["build", str(raw), str(tmp_path / "out"), *SIZE])
    assert "train-00000-of-00001.parquet: not a readable Parquet file" in err and "--tokenizer" not in err
