"""`packer show`: the samples a user looks at before training, from the user's side: keys and
class names as the dataset reads them, captions and transcripts decoded with the dataset's own
tokenizer (equal to the source text's tokens decoded), a PNG of images or waveforms."""

from __future__ import annotations

import json
import shutil

from PIL import Image

from loaders import MMapDataset
from packer.builder.text import load_tokenizer
from packer.cli import main

from ..trees import one_line_error


def _show(capsys, out, *more):
    assert main(["show", str(out), *map(str, more)]) == 0
    return capsys.readouterr().out


def test_show_lists_keys_and_class_names_and_draws_the_images(built, capsys, tmp_path):
    ds = MMapDataset(built["images"])
    printed = _show(capsys, built["images"], "-n", "5", "--png", tmp_path / "grid.png")
    assert f"{len(ds):,} samples): 5 of them" in printed and "png -> " in printed
    first, last = ds[0], ds[len(ds) - 1]
    for sample in (first, last):  # spread evenly: the first and the last among them
        assert f"{sample['key']}  label {int(sample['label'])} {ds.classes[int(sample['label'])]}" in printed
    grid = Image.open(tmp_path / "grid.png")
    assert grid.width > 4 * 160 and grid.height > 2 * 160
    doc = json.loads(_show(capsys, built["aspect"], "-n", "3", "--json"))
    assert [s["image_size"] for s in doc["samples"]] == [list(MMapDataset(built["aspect"])[s["id"]]["image"].shape[:2])
                                                         for s in doc["samples"]]


def test_show_decodes_captions_and_transcripts_with_the_datasets_tokenizer(built, capsys, minilm, tmp_path):
    tok = load_tokenizer(minilm)
    for kind in ("pairs", "audio"):
        doc = json.loads(_show(capsys, built[kind], "-n", "4", "--json"))
        ds = MMapDataset(built[kind])
        for s in doc["samples"]:
            tokens = ds[s["id"]]["tokens"].tolist() if "tokens" in ds.columns else None
            if tokens is not None:
                assert s["text"] == tok.decode(tokens, skip_special_tokens=False) and s["num_tokens"] == len(tokens)
    _show(capsys, built["audio"], "-n", "3", "--png", tmp_path / "clips.png")
    assert Image.open(tmp_path / "clips.png").width >= 480
    err = one_line_error(capsys, ["show", str(built["text"]), "--png", str(tmp_path / "t.png")])
    assert "nothing to draw" in err


def test_a_tokenizer_no_longer_where_it_was_gives_ids_not_other_words(built, capsys, minilm, tmp_path):
    out = tmp_path / "pairs"
    shutil.copytree(built["pairs"], out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tokenizer"]["path"] = str(tmp_path / "gone.json")
    (out / "manifest.json").write_text(json.dumps(manifest))
    printed = _show(capsys, out, "-n", "2")
    assert printed.count("its tokenizer is not at the path recorded") == 2
