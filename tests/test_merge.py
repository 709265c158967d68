"""`packer merge`: never the same samples twice without being asked."""

from __future__ import annotations

import shutil

from loaders import MMapDataset
from packer.cli import main


def build(raw, out) -> None:
    assert main(["build", str(raw), str(out), "-q", "--image-size", "16"]) == 0


def test_the_same_input_twice_is_refused(tmp_path, built, capsys):
    """`packer merge A A OUT` gave every sample twice, exit 0."""
    a = built["images"]
    assert main(["merge", str(a), str(a), str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "is given twice" in err and len(err.strip().splitlines()) == 1
    assert main(["merge", str(a), str(a.parent / "." / a.name), str(tmp_path / "m")]) == 2  # another spelling
    assert not (tmp_path / "m").exists()


def test_keys_in_two_inputs_are_refused_unless_allowed(tmp_path, image_raw, capsys):
    """Two builds of overlapping folders: the shared files' keys are named, with how many there
    are; --allow-duplicate-keys keeps every copy."""
    a, b = tmp_path / "a", tmp_path / "b"
    classes = sorted(p.name for p in image_raw.iterdir() if p.is_dir())
    for name in classes[:3]:
        shutil.copytree(image_raw / name, a / name)
    for name in classes[2:5]:  # classes[2] in both
        shutil.copytree(image_raw / name, b / name)
    build(a, tmp_path / "a.ds")
    build(b, tmp_path / "b.ds")
    shared = len(MMapDataset(tmp_path / "a.ds")) + len(MMapDataset(tmp_path / "b.ds")) - len(
        {p.relative_to(d).as_posix() for d in (a, b) for p in d.rglob("*") if p.is_file()})
    assert shared > 0
    args = ["merge", str(tmp_path / "a.ds"), str(tmp_path / "b.ds"), str(tmp_path / "m")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{shared:,} keys are in more than one input ({classes[2]}/" in err and "--allow-duplicate-keys" in err
    assert not (tmp_path / "m").exists()
    assert main([*args, "--allow-duplicate-keys"]) == 0
    assert len(MMapDataset(tmp_path / "m")) == len(MMapDataset(tmp_path / "a.ds")) + len(MMapDataset(tmp_path / "b.ds"))
