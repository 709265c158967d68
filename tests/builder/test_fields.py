"""--fields from the user's side: the other fields of a record kept as columns (a manifest's, a
Hugging Face Parquet row's, a WebDataset sample's .json keys, a Common Voice row's), typed from
all their values, a default where one is given, a skip naming the field where not."""

from __future__ import annotations

import json
import shutil

import pytest

from loaders import Loader, MMapDataset
from packer.cli import main

from ..trees import one_line_error
from .test_forms import SIZE, _hf, _manifest, _samples, _tar, photos  # noqa: F401 - photos: a fixture


def _fields(out):
    ds = MMapDataset(out)
    m = ds.manifest
    assert m.counts["found"] == m.counts["packed"] + m.counts["skipped"]
    return ds, {s.key: s.reason for s in m.skipped}


def test_a_manifests_fields_are_columns_typed_from_their_values(photos, tmp_path, capsys):  # noqa: F811
    raw = _manifest(photos, tmp_path / "m", "jsonl")
    rows = [json.loads(x) for x in (raw / "data.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        r |= {"speaker": f"spk{i % 3}", "url": f"http://x.invalid/{i}", "score": i / 4 if i % 2 else i}
        if i == 1:
            del r["url"]
        if i == 2:
            del r["speaker"]
        if i == 3:
            r["score"] = "n/a"
    (raw / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["build", str(raw), str(tmp_path / "out"), *SIZE, "--fields", "speaker,url=,score"]) == 0
    assert "not packed" not in capsys.readouterr().out
    ds, skipped = _fields(tmp_path / "out")
    assert [c.dtype for c in ds.manifest.columns if c.name in ("speaker", "url", "score")] == ["|u1", "|u1", "<f8"]
    assert "no 'speaker'" in skipped["data.jsonl:3"] and "'n/a', not a number" in skipped["data.jsonl:4"]
    by_key = {ds[i]["key"]: ds[i] for i in range(len(ds))}
    assert by_key["data.jsonl:2"]["url"] == "" and by_key["data.jsonl:1"]["speaker"] == "spk0"
    assert by_key["data.jsonl:6"]["score"].item() == 1.25 and by_key["data.jsonl:5"]["score"].item() == 4.0
    batch = next(iter(Loader(ds, 4)))
    assert len(batch["speaker"]) == 4 and batch["score"].dtype.is_floating_point


def test_parquet_columns_tar_json_keys_and_common_voice_rows_are_kept(photos, tmp_path, minilm):  # noqa: F811
    import pyarrow as pa
    import pyarrow.parquet as pq

    hf = _hf(photos, tmp_path / "hf")
    path = hf / "data" / "train-00000-of-00001.parquet"
    table = pq.read_table(path)
    n = table.num_rows
    table = table.append_column("source", pa.array([f"cam{i % 2}" for i in range(n)])).append_column(
        "year", pa.array(list(range(2000, 2000 + n))))
    pq.write_table(table.replace_schema_metadata(table.schema.metadata), path)
    assert main(["build", str(hf), str(tmp_path / "o1"), *SIZE, "--fields", "source,year"]) == 0
    ds, _ = _fields(tmp_path / "o1")
    assert [ds[i]["year"].item() for i in range(n)] == list(range(2000, 2000 + n)) and ds[1]["source"] == "cam1"
    tar = _tar(photos, tmp_path / "tar", captions="json")
    assert main(["build", str(tar), str(tmp_path / "o2"), *SIZE, "--no-text", "--fields", "url"]) == 0
    ds, _ = _fields(tmp_path / "o2")
    assert {ds[i]["url"] for i in range(len(ds))} == {"http://example.invalid"}
    from bench import sounds

    cv = tmp_path / "cv"
    (cv / "clips").mkdir(parents=True)
    lines = ["client_id\tpath\tsentence\tage\tgender"]
    for i, p in enumerate(sounds.speech()[:4]):
        shutil.copy(p, cv / "clips" / f"c{i}.wav")
        lines.append(f"id{i}\tc{i}.wav\t{p.stem}\t{['twenties', 'thirties', '', 'forties'][i]}\t{'fm'[i % 2]}")
    (cv / "train.tsv").write_text("\n".join(lines) + "\n")
    assert main(["build", str(cv), str(tmp_path / "o3"), "--sample-rate", "16000", "--tokenizer", str(minilm), "-q",
                 "--fields", "client_id,age=unknown,gender"]) == 0
    ds, _ = _fields(tmp_path / "o3")
    assert [(ds[i]["client_id"], ds[i]["age"]) for i in range(4)] == [("id0", "twenties"), ("id1", "thirties"),
                                                                      ("id2", "unknown"), ("id3", "forties")]


def test_fields_a_folder_has_none_of_are_one_line(photos, tmp_path, capsys):  # noqa: F811
    err = one_line_error(capsys, ["build", str(photos), str(tmp_path / "out"), *SIZE, "--fields", "speaker"])
    assert "--fields" in err and "no fields to keep" in err
    err = one_line_error(capsys, ["build", str(photos), str(tmp_path / "o2"), *SIZE, "--fields", "label"])
    assert "not a field a build can keep" in err


@pytest.mark.parametrize("spec", ["a,a", "bad-name", "x_lengths"])
def test_a_bad_fields_flag_is_refused(photos, tmp_path, capsys, spec):  # noqa: F811
    raw = _manifest(photos, tmp_path / "m", "jsonl")
    assert "--fields" in one_line_error(capsys, ["build", str(raw), str(tmp_path / "out"), *SIZE, "--fields", spec])
