"""Damage is caught: on open (sizes, version) and by `packer verify` (every byte); a killed
build never leaves a dataset dir that opens."""

from __future__ import annotations

import json
import shutil

import pytest

from loaders import MMapDataset
from packer import format as fmt
from packer.cli import main
from packer.errors import IntegrityError, ManifestError
from packer.reader import load_manifest

from .procs import kill_mid_build


@pytest.fixture
def dataset(tmp_path, built):
    out = tmp_path / "ds"
    shutil.copytree(built["text"], out)
    return out


def test_verify_ok(dataset, capsys):
    assert main(["verify", str(dataset)]) == 0
    assert "ok:" in capsys.readouterr().out


def test_verify_catches_a_flipped_byte(dataset, capsys):
    m = load_manifest(dataset)
    target = dataset / m.shards[1].files[0].path
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    target.write_bytes(bytes(raw))
    MMapDataset(dataset)  # same size: opening is cheap and does not hash
    assert main(["verify", str(dataset)]) == 1
    err = capsys.readouterr().err
    assert str(target) in err and "checksum" in err


def test_verify_catches_a_flipped_header_byte(dataset, capsys):
    m = load_manifest(dataset)
    target = dataset / m.shards[0].files[0].path
    raw = bytearray(target.read_bytes())
    raw[30] ^= 0x20  # inside the header dict
    target.write_bytes(bytes(raw))
    assert main(["verify", str(dataset)]) == 1
    assert str(target) in capsys.readouterr().err


def test_truncated_file_is_refused_on_open_and_by_verify(dataset, capsys):
    m = load_manifest(dataset)
    target = dataset / m.shards[-1].files[0].path
    with open(target, "r+b") as f:
        f.truncate(target.stat().st_size - 10)
    with pytest.raises(IntegrityError, match=str(target)):
        MMapDataset(dataset)
    assert main(["verify", str(dataset)]) == 1
    assert "bytes, manifest says" in capsys.readouterr().err


def test_missing_file_is_refused_on_open(dataset):
    m = load_manifest(dataset)
    (dataset / m.shards[0].files[-1].path).unlink()
    with pytest.raises(IntegrityError, match="missing"):
        MMapDataset(dataset)


def test_unknown_major_version_is_refused(dataset):
    path = dataset / fmt.MANIFEST_NAME
    doc = json.loads(path.read_text())
    major = fmt.FORMAT_VERSION[0]
    doc["version"] = f"{major + 1}.0"
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=rf"format version {major + 1}.0 is not supported.*reads {major}.x"):
        MMapDataset(dataset)


@pytest.mark.parametrize("version, key", [("1.0", "sha256"), ("2.0", "xxh3_128")])
def test_an_older_major_dataset_is_refused_in_one_line(dataset, capsys, version, key):
    """1.x listed a sha256 per file, 2.x a plain XXH3-128 of the whole file, 3.0 the
    xxh3_128_rows checksum: an older dataset is named, not misread as damaged."""
    path = dataset / fmt.MANIFEST_NAME
    doc = json.loads(path.read_text())
    doc["version"] = version
    for shard in doc["shards"]:
        for f in shard["files"]:
            f[key] = "0" * 32
            del f["xxh3_128_rows"]
    path.write_text(json.dumps(doc))
    assert main(["info", str(dataset)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"format version {version} is not supported" in err and str(path) in err


def test_newer_minor_version_with_unknown_keys_opens(dataset):
    path = dataset / fmt.MANIFEST_NAME
    doc = json.loads(path.read_text())
    doc["version"] = f"{fmt.FORMAT_VERSION[0]}.7"
    doc["future_key"] = {"anything": 1}
    path.write_text(json.dumps(doc))
    assert len(MMapDataset(dataset)) > 0


def test_garbled_manifest_is_one_line_error(dataset, capsys):
    (dataset / fmt.MANIFEST_NAME).write_text('{"format": "mmpack", "version": "2.0", "kind": ')
    assert main(["info", str(dataset)]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON" in err and err.count("\n") == 1


def test_killed_build_leaves_nothing_that_opens(tmp_path, image_raw, capsys):
    out = tmp_path / "killed"
    kill_mid_build(image_raw, out, ["--image-size", "96", "--shard-size", "4"])
    with pytest.raises(ManifestError, match="incomplete build"):
        MMapDataset(out)
    assert main(["build", str(image_raw), str(out), "--image-size", "16", "-q"]) == 2  # other args: refused
    assert "unfinished build" in capsys.readouterr().err
    assert main(["build", str(image_raw), str(out), "--image-size", "16", "-q", "--overwrite"]) == 0
    assert len(MMapDataset(out)) > 0


def test_killed_overwrite_leaves_nothing_that_opens(tmp_path, image_raw):
    out = tmp_path / "over"
    assert main(["build", str(image_raw), str(out), "--image-size", "16", "-q"]) == 0
    kill_mid_build(image_raw, out, ["--image-size", "96", "--shard-size", "4", "--overwrite"])
    with pytest.raises(ManifestError):
        MMapDataset(out)
