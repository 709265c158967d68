"""The scan of RAW, from the user's side: labels are torchvision ImageFolder's, every file under
RAW is found (links to folders followed, loops refused), and no file name aborts a build."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from loaders import MMapDataset
from packer.cli import main
from packer.dataset.reader import load_manifest


def imagefolder_classes(root: Path) -> list[str]:
    """torchvision.datasets.folder.find_classes, as torchvision 0.28 defines it (used when
    torchvision is not installed)."""
    try:
        from torchvision.datasets.folder import find_classes
    except ImportError:
        return sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    return find_classes(str(root))[0]


@pytest.fixture
def odd_tree(tmp_path, image_raw) -> Path:
    """Class folders as users have them: one empty, one holding only a format that is not packed,
    one a link to a folder elsewhere, one with a link back to itself inside, one hidden, one
    whose name is not UTF-8, and a file whose name is not UTF-8; RAW's own path is not UTF-8."""
    photos = [p for d in sorted(image_raw.iterdir()) if d.is_dir() and d.name != "hostile" for p in sorted(d.iterdir())][:4]
    raw = Path(os.fsdecode(os.fsencode(tmp_path) + b"/r\xe5w"))
    for name in ("apple", "cherry", "kiwi"):
        (raw / name).mkdir(parents=True)
        for p in photos[:2]:
            shutil.copy(p, raw / name / p.name)
    (raw / "banana").mkdir()  # empty: still class 1, as in ImageFolder
    (raw / "date").mkdir()
    (raw / "date" / "IMG_0001.heic").write_bytes(b"\0" * 64)  # only a format the build does not pack
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for k, p in enumerate(photos):
        shutil.copy(p, elsewhere / f"{k}{p.suffix}")
    os.symlink(elsewhere, raw / "fig")  # a linked class folder: its 4 images are found and packed
    os.symlink(raw / "kiwi", raw / "kiwi" / "again")  # a loop
    (raw / ".cache").mkdir()  # hidden: a class for ImageFolder too
    bad = os.fsencode(raw) + b"/gr\xffpe"
    os.mkdir(bad)
    shutil.copy(photos[0], os.fsdecode(bad + b"/a.png"))
    shutil.copy(photos[1], os.fsdecode(os.fsencode(raw / "apple") + b"/caf\xe9.png"))
    return raw


def test_labels_are_imagefolders_and_every_file_is_counted(tmp_path, odd_tree, capsys):
    out = tmp_path / "out"
    assert main(["build", str(odd_tree), str(out), "--image-size", "16"]) == 0
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err
    m = load_manifest(out)
    want = imagefolder_classes(odd_tree)
    assert m.classes == tuple(os.fsencode(c).decode("utf-8", "backslashreplace") for c in want)
    assert m.classes[:4] == (".cache", "apple", "banana", "cherry")
    ds = MMapDataset(out)
    for i in range(len(ds)):
        s = ds[i]
        assert want[int(s["label"])] == s["key"].split("/")[0]
    keys = sorted(ds[i]["key"] for i in range(len(ds)))
    assert sum(k.startswith("fig/") for k in keys) == 4  # the linked folder's images, packed
    skips = {s.key: s.reason for s in m.skipped}
    assert "loop" in skips["kiwi/again"]
    assert "not valid UTF-8" in skips["apple/caf\\xe9.png"] and "not valid UTF-8" in skips["gr\\xffpe/a.png"]
    assert "not an image" in skips["date/IMG_0001.heic"]
    files = 2 * 3 + 1 + 4 + 1 + 1  # apple, cherry, kiwi; date's .heic; fig's 4; grape's; café's
    assert m.counts["found"] == m.counts["packed"] + m.counts["skipped"] == files + 1  # + the loop
    empty = "4 of 8 classes have no packed image: .cache, banana, date, gr\\xffpe"
    assert empty in printed.out
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    assert empty in capsys.readouterr().out


def test_a_new_empty_class_folder_is_a_changed_input(tmp_path, image_raw, capsys):
    """An empty folder shifts ImageFolder's labels after it: a build of RAW run again once one
    is there does not pass the old dataset off as done (its labels would be off by one)."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    for name in ("cat", "dog"):
        shutil.copytree(image_raw / sorted(p.name for p in image_raw.iterdir() if p.is_dir())[0], raw / name)
    args = ["build", str(raw), str(out), "--image-size", "16", "-q"]
    assert main(args) == 0 and main(args) == 0  # the same RAW again: done already
    (raw / "bird").mkdir()
    assert main(args) == 2
    assert "already exists" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    assert load_manifest(out).classes == ("bird", "cat", "dog")
