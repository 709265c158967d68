"""Labels read from records (manifests, tars, Hugging Face Parquet): one rule for integers and
names over the whole input, a mix refused; labels kept beside captions; a label value that is
none (a list, a struct) a skip with its reason. At the user's side: the CLI on files written
by the writers users have; the rule itself over any mix of values (hypothesis)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loaders import Loader, MMapDataset
from packer.builder.forms.labels import assign
from packer.builder.records import Record
from packer.cli import main
from packer.dataset.format import Skip
from packer.errors import ConfigError

from ..trees import one_line_error
from .test_forms import SIZE, _classes, _hf, _manifest, _samples, _tar, photos  # noqa: F401 - photos: a fixture


def test_a_record_with_a_caption_and_a_label_keeps_both(photos, tmp_path, minilm):  # noqa: F811
    """{"image_path", "text", "label", "id"}: a pairs dataset with the label beside the tokens,
    its classes the labels' names; before, the label column was dropped while info listed
    the classes."""
    raw = _manifest(photos, tmp_path / "m", "jsonl", captions=True)
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), *SIZE, "--tokenizer", str(minilm)]) == 0
    ds = MMapDataset(out)
    assert ds.manifest.kind == "pairs" and list(ds.columns) == ["image", "label", "tokens", "key"]
    assert ds.classes == _classes(photos)
    rows = [json.loads(line) for line in (raw / "data.jsonl").read_text().splitlines()]
    assert [ds.classes[int(ds[i]["label"])] for i in range(len(ds))] == [r["label"] for r in rows]
    batch = next(iter(Loader(ds, 4, order="sequential")))
    assert batch["label"].tolist() == [ds.classes.index(r["label"]) for r in rows[:4]]
    assert batch["tokens"].shape[0] == 4


def test_a_tar_with_captions_and_class_labels_keeps_its_labels(photos, tmp_path, minilm):  # noqa: F811
    raw = _tar(photos, tmp_path / "tar", captions="txt")
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), *SIZE, "--tokenizer", str(minilm),
                 "--classes", str(raw / "classes.txt")]) == 0
    ds = MMapDataset(out)
    assert "label" in ds.columns and ds.classes == _classes(photos)
    assert [ds.classes[int(ds[i]["label"])] for i in range(len(ds))] == [c for _, c, _ in _samples(photos)]


def _tar_of_labels(photos, raw, values):  # noqa: F811
    import webdataset as wds

    raw.mkdir(parents=True)
    files = _samples(photos)
    with wds.TarWriter(str(raw / "train-000000.tar")) as w:
        for i, value in enumerate(values):
            p = files[i % len(files)][0]
            w.write({"__key__": f"{i:06d}", p.suffix[1:].lower(): p.read_bytes(), "cls": value})
    return raw


def test_integer_and_text_labels_mixed_are_refused_naming_both_kinds(photos, tmp_path, capsys):  # noqa: F811
    """`.cls` members "0", "1", "-3", "cat": before, classes were the sorted text of every value
    and "0" was read as class "-3". Now one line naming both kinds and --classes; the same in a
    TSV manifest's label column."""
    raw = _tar_of_labels(photos, tmp_path / "tar", ["0", "1", "-3", "cat"])
    err = one_line_error(capsys, ["build", str(raw), str(tmp_path / "out"), *SIZE])
    assert "mix integers" in err and "'cat'" in err and "--classes" in err and "train-000000.tar" in err
    tsv = _manifest(photos, tmp_path / "tsv", "tsv")
    lines = (tsv / "data.tsv").read_text().splitlines()
    lines[2] = lines[2].rsplit("\t", 1)[0] + "\t7"
    (tsv / "data.tsv").write_text("\n".join(lines) + "\n")
    err = one_line_error(capsys, ["build", str(tsv), str(tmp_path / "out2"), *SIZE])
    assert "mix integers (7)" in err and "data.tsv" in err


def test_integer_labels_alone_index_the_classes(photos, tmp_path):  # noqa: F811
    raw = _tar_of_labels(photos, tmp_path / "tar", ["2", "0", " 1", "-3"])
    assert main(["build", str(raw), str(tmp_path / "out"), *SIZE]) == 0
    ds = MMapDataset(tmp_path / "out")
    assert ds.classes == ["0", "1", "2"] and ds.targets.tolist() == [2, 0, 1]
    assert {s.key: s.reason for s in ds.manifest.skipped} == {"train-000000.tar:000003": "label -3 is outside the 3 "
                                                                                         "classes"}


def test_parquet_labels_that_are_lists_or_structs_are_skips_not_a_traceback(photos, tmp_path, capsys):  # noqa: F811
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = [p for p, _, _ in _samples(photos)]
    for name, labels in (("list", [[1, 2]] * len(files)), ("struct", [{"x": 1}] * len(files))):
        raw = tmp_path / name
        raw.mkdir()
        labels[0] = [0] if name == "list" else {"x": 0}
        table = pa.table({"image": [p.read_bytes() for p in files], "label": labels})
        pq.write_table(table, raw / "train-00000-of-00001.parquet")
        err = one_line_error(capsys, ["build", str(raw), str(tmp_path / f"out-{name}"), *SIZE])
        assert "nothing to pack" in err and ("a list, not an int" in err if name == "list" else "a dict, not" in err)


def test_huggingface_classlabel_names_given_twice_are_refused(photos, tmp_path, capsys):  # noqa: F811
    """ClassLabel(names=["cat", "dog", "cat"]): class_to_idx would lose one of the two; refused
    in one line naming the name."""
    import pyarrow.parquet as pq

    raw = _hf(photos, tmp_path / "hf")
    path = raw / "data" / "train-00000-of-00001.parquet"
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[b"huggingface"])
    names = meta["info"]["features"]["label"]["names"]
    meta["info"]["features"]["label"]["names"] = [*names[:-1], names[0]]
    pq.write_table(table.replace_schema_metadata({b"huggingface": json.dumps(meta).encode()}), path)
    err = one_line_error(capsys, ["build", str(raw), str(tmp_path / "out"), *SIZE])
    assert f"{names[0]!r} twice" in err and "ClassLabel" in err


_VALUE = st.one_of(st.integers(-3, 12), st.integers(-3, 12).map(str),
                   st.sampled_from(["cat", "dog", "Zebra", "a b", "-", "1.5", "x1"]))


@given(values=st.lists(_VALUE, min_size=1, max_size=24), named=st.booleans())
def test_one_rule_for_any_mix_of_label_values(values, named):
    """Every label value an integer: each indexes the classes ("0" ... the largest, or the names
    given); every value a name: classes are the names sorted (or the names given), each label
    its name's place; a mix: refused. A label outside the classes is a skip."""
    met: dict = {}
    records = [Record(f"k{i}", "p", label=met.setdefault(v, len(met))) for i, v in enumerate(values)]
    ints = [isinstance(v, int) or v.lstrip("-").isdigit() for v in values]
    given_names = tuple(f"c{i}" for i in range(6)) + ("cat", "dog") if named else None
    if any(ints) and not all(ints):
        with pytest.raises(ConfigError, match="mix integers"):
            assign(records, met, given_names)
        return
    out, classes = assign(records, met, given_names)
    if all(ints):
        numbers = [int(v) for v in values]
        assert classes == (given_names or tuple(str(i) for i in range(max(max(numbers), -1) + 1)))
    else:
        assert classes == (given_names or tuple(sorted({str(v) for v in values})))
    for value, r in zip(values, out):
        want = int(value) if all(ints) else (classes.index(value) if value in classes else None)
        if want is None or not 0 <= want < len(classes):
            assert isinstance(r, Skip) and ("outside" in r.reason or "none of" in r.reason)
        else:
            assert isinstance(r, Record) and r.label == want
