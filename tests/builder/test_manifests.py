"""Manifests and tables as users' tools write them: Excel's CSV with a byte-order mark and its
UTF-16 "Unicode Text", Common Voice's TSV with raw quotes, two manifests of one folder, rows
with a field too many, a NUL byte in a path, paths out of RAW, and Hugging Face shards named
with a hash. Each builds the dataset it is, or is a skip or a one-line error with its reason;
found = packed + skipped."""

from __future__ import annotations

import csv
import json
import os
import shutil

from loaders import MMapDataset
from packer.cli import main

from ..trees import one_line_error
from .test_forms import SIZE, _classes, _hf, _manifest, _samples, photos  # noqa: F401 - photos: a fixture


def _rows(raw):
    with open(raw / "data.csv", newline="") as f:
        return list(csv.reader(f))


def _built(out):
    ds = MMapDataset(out)
    m = ds.manifest
    assert m.counts["found"] == m.counts["packed"] + m.counts["skipped"]
    return ds, {s.key: s.reason for s in m.skipped}


def test_excel_csv_with_a_byte_order_mark_and_its_utf16_text_are_manifests(photos, tmp_path):  # noqa: F811
    """Excel's "CSV UTF-8" starts with a byte-order mark: before, the folder was built as class
    folders (one class, 'images') with the CSV a skip. Its "Unicode Text" is UTF-16 TSV."""
    raw = _manifest(photos, tmp_path / "bom", "csv")
    rows = _rows(raw)
    with open(raw / "data.csv", "w", newline="", encoding="utf-8-sig") as f:
        csv.writer(f).writerows(rows)
    utf16 = _manifest(photos, tmp_path / "utf16", "csv")
    os.unlink(utf16 / "data.csv")
    with open(utf16 / "data.tsv", "w", newline="", encoding="utf-16") as f:
        csv.writer(f, delimiter="\t").writerows(rows)
    for case in (raw, utf16):
        out = tmp_path / f"out-{case.name}"
        assert main(["build", str(case), str(out), *SIZE]) == 0
        ds, skipped = _built(out)
        assert ds.manifest.build["input"]["form"] == "manifest" and not skipped
        assert ds.classes == _classes(photos) and len(ds) == len(rows) - 1


def test_input_manifest_on_files_that_name_no_image_says_why(tmp_path, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "data.jsonl").write_text(json.dumps({"path": "src/a.py", "text": "def f(): pass"}) + "\n")
    err = one_line_error(capsys, ["build", str(raw), str(tmp_path / "out"), *SIZE, "--input", "manifest"])
    assert "holds no manifest of image files" in err and "'path', 'text'" in err and "data.jsonl" in err


def test_two_manifests_of_one_folder_are_refused_and_one_is_picked(photos, tmp_path, capsys):  # noqa: F811
    """data.jsonl and data.csv naming the same images: before, every image was packed twice."""
    raw = _manifest(photos, tmp_path / "m", "jsonl")
    rows = [json.loads(line) for line in (raw / "data.jsonl").read_text().splitlines()]
    with open(raw / "data.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    err = one_line_error(capsys, ["build", str(raw), str(tmp_path / "out"), *SIZE])
    assert "data.csv and data.jsonl both name" in err and "--manifest FILE" in err
    assert main(["build", str(raw), str(tmp_path / "out"), *SIZE, "--manifest", "data.csv"]) == 0
    ds, skipped = _built(tmp_path / "out")
    assert len(ds) == len(rows) and skipped == {"data.jsonl": "not --manifest data.csv"}
    assert ds[0]["key"] == "data.csv:2"
    err = one_line_error(capsys, ["build", str(raw), str(tmp_path / "o2"), *SIZE, "--manifest", "nope.csv"])
    assert "--manifest nope.csv: no such manifest file" in err


def test_common_voice_tsv_with_raw_quotes_keeps_every_sentence(tmp_path, minilm):
    """Common Voice writes its TSV without quoting, and its sentences hold unbalanced quotes:
    read with CSV quoting, a quote ate the tabs and rows after it (the clips after it were then
    skipped as 'audio without a transcript'). --quoted-tsv reads CSV quoting where a TSV has it."""
    from bench import sounds
    from packer.builder.text import load_tokenizer

    raw = tmp_path / "cv"
    (raw / "clips").mkdir(parents=True)
    voices = sounds.speech()
    sentences = [f'"{p.stem}, he said' if i % 3 == 0 else f'{p.stem} isn\'t "quoted" here' for i, p in
                 enumerate(voices)]
    lines = ["client_id\tpath\tsentence\tup_votes\tdown_votes\tage\tgender\taccents\tlocale\tsegment"]
    for i, (p, text) in enumerate(zip(voices, sentences)):
        shutil.copy(p, raw / "clips" / f"common_voice_en_{i}.wav")
        lines.append(f"c{i}\tcommon_voice_en_{i}.wav\t{text}\t2\t0\t\t\t\ten\t")
    (raw / "train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), "--sample-rate", "16000", "--tokenizer", str(minilm), "-q"]) == 0
    ds, skipped = _built(out)
    tok = load_tokenizer(minilm)  # its padding and truncation off, as a build's
    assert len(ds) == len(voices) and not skipped
    got = {ds[i]["key"]: ds[i]["tokens"].tolist() for i in range(len(ds))}
    want = {f"clips/common_voice_en_{i}.wav": tok.encode(t, add_special_tokens=False).ids
            for i, t in enumerate(sentences)}
    assert got == want
    assert main(["build", str(raw), str(tmp_path / "quoted"), "--sample-rate", "16000", "--tokenizer", str(minilm),
                 "--quoted-tsv", "-q"]) == 0
    assert len(MMapDataset(tmp_path / "quoted")) < len(voices)  # CSV quoting, as asked: rows merged


def test_a_row_with_a_field_too_many_a_nul_byte_or_a_path_out_of_raw_is_a_skip(photos, tmp_path):  # noqa: F811
    """Before: a CSV row with an extra field published the dataset, then the summary crashed
    (rc 1); a NUL byte aborted the build (embedded null byte); ../, absolute paths and links out
    of RAW packed whatever the manifest named."""
    raw = _manifest(photos, tmp_path / "m", "csv")
    rows = _rows(raw)
    outside = tmp_path / "outside"
    shutil.copytree(photos, outside)
    first = _samples(photos)[0][0].relative_to(photos).as_posix()
    os.symlink(outside / first, raw / "link.png")
    extra = [[rows[1][0], rows[1][1], "surplus"], [rows[2][0] + "\0x", rows[2][1]],
             [f"../outside/{first}", "x"], [str(outside / first), "x"], ["link.png", "x"]]
    with open(raw / "data.csv", "w", newline="") as f:
        csv.writer(f).writerows([rows[0], *extra, *rows[3:]])
    assert main(["build", str(raw), str(tmp_path / "out"), *SIZE]) == 0
    ds, skipped = _built(tmp_path / "out")
    assert "3 fields where its header names 2" in skipped["data.csv:2"]
    assert "holds a NUL byte" in skipped["data.csv:3"]
    assert all("outside RAW" in skipped[f"data.csv:{n}"] and "--allow-outside" in skipped[f"data.csv:{n}"]
               for n in (4, 5, 6))
    assert len(ds) == len(rows) - 3 and set(ds.classes) <= set(_classes(photos))
    assert main(["build", str(raw), str(tmp_path / "allowed"), *SIZE, "--allow-outside"]) == 0
    ds, skipped = _built(tmp_path / "allowed")
    assert len(ds) == len(rows) - 3 + 3 and "x" in ds.classes and not any("outside" in r for r in skipped.values())


def test_huggingface_shards_named_with_a_hash_are_their_split(photos, tmp_path, capsys):  # noqa: F811
    """`train-00000-of-00001-5f3a2c1e9b3a5c8d.parquet`, as older push_to_hub named them: before,
    train and test were packed together, and --split train found no such split."""
    raw = tmp_path / "hf"
    _hf(photos, raw, name="train-00000-of-00001-5f3a2c1e9b3a5c8d.parquet")
    _hf(photos, raw, name="test-00000-of-00001-0b1c2d3e4f5a6b7c.parquet")
    err = one_line_error(capsys, ["build", str(raw), str(tmp_path / "out"), *SIZE])
    assert "splits test, train" in err
    assert main(["build", str(raw), str(tmp_path / "out"), *SIZE, "--split", "train"]) == 0
    ds, skipped = _built(tmp_path / "out")
    assert len(ds) == len(_samples(photos))
    assert skipped == {"data/test-00000-of-00001-0b1c2d3e4f5a6b7c.parquet": "split test, not --split train"}
