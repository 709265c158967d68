"""Damage is caught: on open (sizes, version) and by `packer verify` (every byte); a killed
build never leaves a dataset dir that opens."""

from __future__ import annotations

import json
import shutil

import pytest

from loaders import MMapDataset
from packer.dataset import format as fmt
from packer.cli import main
from packer.errors import IntegrityError, ManifestError
from packer.dataset.reader import load_manifest

from ..procs import kill_mid_build


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
    with pytest.raises(ManifestError, match=rf"format version {major + 1}.0 is not supported.*reads 1.x to {major}.x"):
        MMapDataset(dataset)


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


def test_a_killed_overwrite_leaves_the_old_dataset_whole_and_the_same_command_finishes(tmp_path, image_raw):
    """--overwrite builds into a generation of its own: until its manifest is in place the old
    dataset is what opens, whole and verified; the same command run again completes the new one."""
    out = tmp_path / "over"
    assert main(["build", str(image_raw), str(out), "--image-size", "16", "-q"]) == 0
    before = [MMapDataset(out)[i]["image"].clone() for i in range(5)]
    kill_mid_build(image_raw, out, ["--image-size", "96", "--shard-size", "4", "--overwrite"])
    ds = MMapDataset(out)
    assert ds.manifest.column("image").shape == (16, 16, 3) and main(["verify", str(out)]) == 0
    assert all(ds[i]["image"].equal(before[i]) for i in range(5))
    again = ["build", str(image_raw), str(out), "--image-size", "96", "--shard-size", "4", "-q", "--overwrite"]
    assert main(again) == 0
    assert MMapDataset(out).manifest.column("image").shape == (96, 96, 3) and main(["verify", str(out)]) == 0
    # the reader opened before still reads the old build, every shard of it: its generation stays
    assert ds.manifest.generation in {p.name for p in out.iterdir()}
    assert [ds[i]["label"].item() for i in range(len(ds))] == [ds[i]["label"].item() for i in range(len(ds))]
    assert all(ds[i]["image"].equal(before[i]) for i in range(5)) and ds[len(ds) - 1]["image"].shape == (16, 16, 3)
    del ds
    assert main(again) == 0  # no reader holds the old one now: it goes
    assert {p.name for p in out.iterdir() if not p.name.startswith(".")} == {
        fmt.MANIFEST_NAME, MMapDataset(out).manifest.generation}


@pytest.mark.parametrize("edit", ["twice", "dropped"])
def test_a_manifest_that_lists_a_shard_twice_or_drops_one_does_not_open(tmp_path, built, edit):
    """Counts fixed up to match, such a manifest opened and verified: a dataset of other samples
    than its build's."""
    from packer.errors import MmpackError
    from packer.dataset.verify import verify

    root = tmp_path / "ds"
    shutil.copytree(built["images"], root)
    doc = json.loads((root / fmt.MANIFEST_NAME).read_text())
    shards = doc["shards"]
    if edit == "twice":
        shards.insert(2, shards[1])
        doc["counts"]["packed"] += shards[1]["num_samples"]
    else:
        doc["counts"]["packed"] -= shards.pop(1)["num_samples"]
    doc["counts"]["found"] = doc["counts"]["packed"] + doc["counts"]["skipped"]
    (root / fmt.MANIFEST_NAME).write_text(json.dumps(doc))
    want = "comes after shard" if edit == "twice" else "a shard dir the manifest does not list"
    with pytest.raises(MmpackError, match=want):
        MMapDataset(root)
    with pytest.raises(MmpackError, match=want):
        verify(root)
