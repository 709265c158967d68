"""--append (and merge) against a build of the union; a changed tokenizer; refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from loaders import MMapDataset
from packer.cli import main
from packer.dataset.reader import load_manifest



from ..trees import IMG, build, by_key


def _split_images(image_raw: Path, a: Path, b: Path) -> None:
    """Class folders alternately into A and B; one class in both (different files)."""
    classes = sorted(p.name for p in image_raw.iterdir() if p.is_dir())
    for k, name in enumerate(classes):
        files = sorted((image_raw / name).iterdir())
        if k == 0:  # shared class: first half of its files in A, the rest in B
            half = len(files) // 2
            for dest, part in ((a, files[:half]), (b, files[half:])):
                (dest / name).mkdir(parents=True)
                for f in part:
                    shutil.copy(f, dest / name / f.name, follow_symlinks=False)
        else:
            shutil.copytree(image_raw / name, (b if k % 2 else a) / name, symlinks=True)


def test_merge_and_append_equal_a_build_of_the_union(tmp_path, image_raw, capsys):
    a, b, union = tmp_path / "a", tmp_path / "b", tmp_path / "union"
    _split_images(image_raw, a, b)
    shutil.copytree(a, union, symlinks=True)
    shutil.copytree(b, union, symlinks=True, dirs_exist_ok=True)
    for raw in (a, b, union):
        build(raw, tmp_path / f"{raw.name}.ds", *IMG)
    want = by_key(tmp_path / "union.ds")
    whole = load_manifest(tmp_path / "union.ds")

    assert main(["merge", str(tmp_path / "b.ds"), str(tmp_path / "a.ds"), str(tmp_path / "merged")]) == 0
    assert by_key(tmp_path / "merged") == want  # b first: labels reconciled by class name
    merged = load_manifest(tmp_path / "merged")
    assert merged.counts == whole.counts and set(merged.classes) == set(whole.classes)
    assert main(["verify", str(tmp_path / "merged")]) == 0

    appended = tmp_path / "appended"
    shutil.copytree(tmp_path / "a.ds", appended)
    # B's classes are new to A's dataset: numbered after A's, not as ImageFolder numbers the union
    assert main(["build", str(union), str(appended), *map(str, IMG), "--append", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--allow-new-classes" in err and "class folder(s) the dataset" in err and err.count("\n") == 1
    build(union, appended, *IMG, "--append", "--allow-new-classes")
    new = load_manifest(appended).build["appended"][-1]["new_classes"]
    assert new == [c for c in whole.classes if c not in load_manifest(tmp_path / "a.ds").classes]
    assert by_key(appended) == want
    assert load_manifest(appended).counts == whole.counts
    build(union, appended, *IMG, "--append")  # nothing new: unchanged
    assert by_key(appended) == want and load_manifest(appended).counts == whole.counts


def test_a_changed_tokenizer_file_at_the_same_path_is_used(tmp_path, text_raw, minilm):
    """Two builds in one process, the tokenizer file rewritten in between at the same path: the
    second build tokenizes with the new file (a cache by path alone served the old one)."""
    tok_path = tmp_path / "tokenizer.json"
    doc = json.loads(Path(minilm).read_text())
    tok_path.write_text(json.dumps(doc))
    args = ("--tokenizer", tok_path, "--shard-size", "16KB", "--workers", "1")
    build(text_raw, tmp_path / "a", *args)
    old = np.concatenate([s["tokens"].numpy() for s in MMapDataset(tmp_path / "a")])
    x, y = (int(t) for t in np.bincount(old).argsort()[-2:])  # the two commonest tokens: swap their ids
    vocab = doc["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[x]], vocab[by_id[y]] = y, x
    tok_path.write_text(json.dumps(doc))
    build(text_raw, tmp_path / "b", *args)
    new = np.concatenate([s["tokens"].numpy() for s in MMapDataset(tmp_path / "b")])
    want = old.copy()
    want[old == x], want[old == y] = y, x
    assert new.tolist() == want.tolist()


def test_append_text_and_refusals(tmp_path, text_raw, minilm, big_tokenizer, capsys):
    half = tmp_path / "half"
    half.mkdir()
    for p in sorted(text_raw.iterdir())[::2]:
        (shutil.copytree if p.is_dir() else shutil.copy2)(p, half / p.name)  # mtimes kept: the same files
    text = ["--tokenizer", minilm, "--append-eos", "--shard-size", "16KB"]
    build(text_raw, tmp_path / "whole", *text)
    build(half, tmp_path / "grown", *text)
    build(text_raw, tmp_path / "grown", *text, "--append")
    assert by_key(tmp_path / "grown") == by_key(tmp_path / "whole")
    assert main(["build", str(text_raw), str(tmp_path / "grown"), "-q", "--tokenizer", str(big_tokenizer),
                 "--append-eos", "--append"]) == 2
    assert "columns differ" in capsys.readouterr().err  # uint32 tokens vs uint16
    assert main(["merge", str(tmp_path / "whole"), str(tmp_path / "grown"), str(tmp_path / "m"),
                 "--allow-duplicate-keys"]) == 0  # the same documents twice, asked for
    other = tmp_path / "other.json"  # the same vocabulary, another file: another sha256
    other.write_text(Path(minilm).read_text() + "\n")
    build(text_raw, tmp_path / "other", "--tokenizer", other, "--append-eos", "--shard-size", "16KB")
    assert main(["merge", str(tmp_path / "whole"), str(tmp_path / "other"), str(tmp_path / "m2")]) == 2
    assert "another tokenizer" in capsys.readouterr().err
    assert main(["build", str(text_raw), str(tmp_path / "other"), "-q", "--tokenizer", str(minilm),
                 "--append-eos", "--append"]) == 2
    assert "not the one the dataset was built with" in capsys.readouterr().err
