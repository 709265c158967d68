"""The input forms people's data comes in, written with the writers they use (the `datasets`
library, `webdataset.TarWriter`, pyarrow, the csv and json modules), from the same real photos:
each builds the image column a folder of them builds, byte for byte, with the same labels and
class names; captions become the tokens sidecar captions do; hostile inputs are skips with
their reason or one-line errors; found = packed + skipped."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loaders import MMapDataset
from packer.cli import main
from packer.dataset.format import Skip

from ..trees import one_line_error

SIZE = ["--image-size", "16", "-q"]


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """Class folders of real photo crops, one format each, a caption each (class name + index)."""
    from bench import data

    raw = tmp_path_factory.mktemp("forms") / "folder"
    data.make_image_folders(raw, 24, seed=5, min_side=40, max_side=200)
    return raw


def _samples(raw: Path) -> list[tuple[Path, str, str]]:
    """(file, class, caption) in the folder's order (sorted relative paths)."""
    files = sorted((p for p in raw.rglob("*") if p.is_file()), key=lambda p: p.relative_to(raw).as_posix())
    return [(p, p.parent.name, f"a photo of {p.parent.name} number {i}") for i, p in enumerate(files)]


def _classes(raw: Path) -> list[str]:
    return sorted(d.name for d in raw.iterdir() if d.is_dir())


def _hf(raw: Path, out: Path, *, captions: bool = False, name: str = "train-00000-of-00001.parquet") -> Path:
    import datasets
    from datasets import ClassLabel, Dataset, Image

    datasets.disable_progress_bars()  # its bars go to stderr, which the one-line error tests read
    samples, classes = _samples(raw), _classes(raw)
    rows = {"image": [{"bytes": p.read_bytes(), "path": p.name} for p, _, _ in samples],
            "label": [classes.index(c) for _, c, _ in samples]}
    if captions:
        rows["text"] = [t for _, _, t in samples]
    ds = Dataset.from_dict(rows).cast_column("image", Image()).cast_column("label", ClassLabel(names=classes))
    (out / "data").mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(out / "data" / name))
    return out


def _tar(raw: Path, out: Path, *, captions: str | None = None, name: str = "train-000000.tar") -> Path:
    import webdataset as wds

    classes = _classes(raw)
    out.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(out / name)) as w:
        for i, (p, c, t) in enumerate(_samples(raw)):
            sample = {"__key__": f"{i:06d}", p.suffix[1:].lower(): p.read_bytes(), "cls": str(classes.index(c))}
            if captions == "txt":
                sample["txt"] = t
            elif captions == "json":
                sample["json"] = json.dumps({"caption": t, "url": "http://example.invalid"})
            w.write(sample)
    (out / "classes.txt").write_text("\n".join(classes) + "\n")
    return out


def _manifest(raw: Path, out: Path, fmt: str, *, captions: bool = False) -> Path:
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(raw, out / "images", dirs_exist_ok=True)
    rows = [{"image_path": f"images/{p.relative_to(raw).as_posix()}", "label": c, **({"caption": t} if captions else {})}
            for p, c, t in _samples(raw)]
    if fmt == "jsonl":
        (out / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        (out / "data.json").write_text(json.dumps(rows))
    elif fmt in ("csv", "tsv"):
        with open(out / f"data.{fmt}", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="," if fmt == "csv" else "\t")
            w.writeheader()
            w.writerows(rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), out / "data.parquet", row_group_size=7)
    return out


def _image_bytes(out: Path) -> list[bytes]:
    return [p.read_bytes() for p in sorted(out.rglob("image.npy"))]


def _built_with_skips(raw: Path, out: Path):
    """The dataset RAW builds, and its skips' reasons by key."""
    assert main(["build", str(raw), str(out), *SIZE]) == 0
    m = MMapDataset(out).manifest
    return m, {s.key: s.reason for s in m.skipped}


@pytest.fixture(scope="module")
def folder_built(photos, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("forms-out") / "folder"
    assert main(["build", str(photos), str(out), *SIZE, "--shard-size", "10"]) == 0
    return out


@pytest.mark.parametrize("form", ["hf", "tar", "jsonl", "json", "csv", "tsv", "parquet-paths"])
def test_every_form_builds_the_folders_image_column_labels_and_classes(photos, folder_built, tmp_path, form):
    raw = tmp_path / form
    extra = []
    if form == "hf":
        _hf(photos, raw)
    elif form == "tar":
        _tar(photos, raw)
        extra = ["--classes", str(raw / "classes.txt"), "--kind", "tar"]  # a form named as --kind forces it too
    else:
        _manifest(photos, raw, form.replace("parquet-paths", "parquet"))
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), *SIZE, "--shard-size", "10", "--workers", "2", *extra]) == 0
    assert _image_bytes(out) == _image_bytes(folder_built)
    got, want = MMapDataset(out), MMapDataset(folder_built)
    assert got.classes == want.classes and got.targets.tolist() == want.targets.tolist()
    m = got.manifest
    assert m.counts["found"] == m.counts["packed"] + m.counts["skipped"] and m.counts["packed"] == len(want)
    assert m.build["input"]["form"] == {"hf": "parquet", "tar": "tar"}.get(form, "manifest")


def test_a_tar_without_class_names_numbers_its_classes_and_any_worker_count_gives_the_same_bytes(photos, tmp_path):
    raw = _tar(photos, tmp_path / "tar")
    outs = [tmp_path / f"out{w}" for w in (1, 2)]
    for w, out in zip((1, 2), outs):
        assert main(["build", str(raw), str(out), *SIZE, "--workers", str(w)]) == 0
    assert _image_bytes(outs[0]) == _image_bytes(outs[1])
    ds = MMapDataset(outs[0])
    assert ds.classes == [str(i) for i in range(len(_classes(photos)))] and ds[0]["key"] == "train-000000.tar:000000"


@pytest.mark.parametrize("form", ["hf", "tar-txt", "tar-json", "jsonl"])
def test_captions_in_every_form_tokenize_as_sidecar_captions_do(photos, tmp_path, minilm, form):
    sidecar = tmp_path / "sidecar"
    sidecar.mkdir()
    for i, (p, _, t) in enumerate(_samples(photos)):
        (sidecar / f"{i:03d}{p.suffix}").write_bytes(p.read_bytes())
        (sidecar / f"{i:03d}.txt").write_text(t)
    raw = tmp_path / form
    if form == "hf":
        _hf(photos, raw, captions=True)
    elif form.startswith("tar"):
        _tar(photos, raw, captions=form.split("-")[1])
    else:
        _manifest(photos, raw, "jsonl", captions=True)
    want, got = tmp_path / "want", tmp_path / "got"
    assert main(["build", str(sidecar), str(want), *SIZE, "--tokenizer", str(minilm)]) == 0
    assert main(["build", str(raw), str(got), *SIZE, "--tokenizer", str(minilm)]) == 0
    a, b = MMapDataset(want), MMapDataset(got)
    assert b.manifest.kind == "pairs" and len(a) == len(b)
    for i in range(len(a)):
        assert a[i]["tokens"].tolist() == b[i]["tokens"].tolist()
        assert np.array_equal(a[i]["image"].numpy(), b[i]["image"].numpy())


def test_captions_without_a_tokenizer_are_an_error_and_no_text_packs_the_images_saying_so(photos, tmp_path, capsys):
    raw = _manifest(photos, tmp_path / "m", "jsonl", captions=True)
    err = one_line_error(capsys, ["build", str(raw), str(tmp_path / "out"), *SIZE])
    assert "--tokenizer" in err and "--no-text" in err
    assert main(["build", str(raw), str(tmp_path / "out"), "--image-size", "16", "--no-text"]) == 0
    out = capsys.readouterr().out
    assert "not packed: caption" in out
    ds = MMapDataset(tmp_path / "out")
    assert ds.manifest.kind == "images" and "tokens" not in ds.columns and ds.classes == _classes(photos)


def test_splits_are_named_and_one_is_picked(photos, tmp_path, capsys):
    raw = tmp_path / "hf"
    _hf(photos, raw, name="train-00000-of-00001.parquet")
    _hf(photos, raw, name="test-00000-of-00001.parquet")
    err = one_line_error(capsys, ["build", str(raw), str(tmp_path / "out"), *SIZE])
    assert "splits test, train" in err and "--split" in err
    assert main(["build", str(raw), str(tmp_path / "out"), *SIZE, "--split", "train"]) == 0
    skipped = {s.key: s.reason for s in MMapDataset(tmp_path / "out").manifest.skipped}
    assert skipped == {"data/test-00000-of-00001.parquet": "split test, not --split train"}
    assert "no such split" in one_line_error(capsys, ["build", str(raw), str(tmp_path / "o2"), *SIZE, "--split", "va"])


def test_a_form_named_twice_differently_is_one_line(photos, tmp_path, capsys):
    err = one_line_error(capsys, ["build", str(_tar(photos, tmp_path / "tar")), str(tmp_path / "out"), *SIZE,
                                  "--kind", "tar", "--input", "parquet"])
    assert "name the input form once" in err


def test_a_named_field_no_record_has_is_an_error_naming_the_fields(photos, tmp_path, capsys):
    raw = _manifest(photos, tmp_path / "m", "jsonl")
    err = one_line_error(capsys, ["build", str(raw), str(tmp_path / "out"), *SIZE, "--label-key", "class"])
    assert "--label-key 'class'" in err and "'image_path'" in err and "'label'" in err


def test_hostile_manifest_records_are_skips_with_their_reasons(photos, tmp_path):
    raw = _manifest(photos, tmp_path / "m", "jsonl")
    lines = (raw / "data.jsonl").read_text().splitlines()
    (raw / "images" / "adir.jpg").mkdir()
    bad = ['{"image_path": "images/missing.jpg", "label": "x"}', "this is not json",
           '{"image_path": "images/adir.jpg", "label": "x"}', '{"image_path": 7, "label": "x"}',
           '{"label": "x"}', '{"image_path": "images/' + lines[0].split('images/')[1].split('"')[0] + '", "label": [1]}']
    (raw / "data.jsonl").write_text("\n".join(lines + bad) + "\n")
    m, reasons = _built_with_skips(raw, tmp_path / "out")
    n = len(lines)
    assert "No such file" in reasons[f"data.jsonl:{n + 1}"] and "not JSON" in reasons[f"data.jsonl:{n + 2}"]
    assert "a folder" in reasons[f"data.jsonl:{n + 3}"] and "no image path" in reasons[f"data.jsonl:{n + 4}"]
    assert "no image path" in reasons[f"data.jsonl:{n + 5}"] and "list" in reasons[f"data.jsonl:{n + 6}"]
    assert m.counts == {"found": n + 6, "packed": n, "skipped": 6}


def test_hostile_parquet_files_and_rows_are_skips_or_one_line_errors(photos, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = _hf(photos, tmp_path / "hf")
    good = raw / "data" / "train-00000-of-00001.parquet"
    table = pq.read_table(good)
    images = table.column("image").to_pylist()
    images[2] = {"bytes": b"not an image at all", "path": "x.jpg"}
    images[3] = {"bytes": None, "path": None}
    pq.write_table(table.set_column(0, "image", pa.array(images, type=table.schema.field("image").type))
                   .replace_schema_metadata(table.schema.metadata), good)
    (raw / "data" / "train-00001-of-00002.parquet").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    m, reasons = _built_with_skips(raw, tmp_path / "out")
    assert "not an image" in reasons["data/train-00000-of-00001.parquet:2"]
    assert "no image bytes" in reasons["data/train-00000-of-00001.parquet:3"]
    assert "not a readable Parquet file" in reasons["data/train-00001-of-00002.parquet"]
    assert m.counts["found"] == m.counts["packed"] + m.counts["skipped"] == len(images) + 1
    pq.write_table(pa.table({"image": list(range(3)), "label": [0, 1, 2]}), raw / "data" / "train-00000-of-00001.parquet")
    os.unlink(raw / "data" / "train-00001-of-00002.parquet")
    err = one_line_error(capsys, ["build", str(raw), str(tmp_path / "o2"), *SIZE, "--image-key", "image",
                                  "--input", "parquet"])
    assert "not image bytes" in err


def test_hostile_tar_members_are_skips_with_their_reasons(photos, tmp_path):
    raw = _tar(photos, tmp_path / "tar")
    path = raw / "train-000000.tar"
    from bench import data

    bomb = next(p for p in data.hostile_images() if p.name == "decompression_bomb.gif").read_bytes()
    with tarfile.open(path, "a") as t:  # a bomb, a link, a FIFO, then a member cut short at the end
        import io

        for name, payload in (("zz0000.gif", bomb), ("zz0000.cls", b"0")):
            member = tarfile.TarInfo(name)
            member.size = len(payload)
            t.addfile(member, io.BytesIO(payload))
        link = tarfile.TarInfo("zz0001.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        t.addfile(link)
        fifo = tarfile.TarInfo("zz0002.jpg")
        fifo.type = tarfile.FIFOTYPE
        t.addfile(fifo)
        payload = next((photos / _classes(photos)[0]).glob("*")).read_bytes()
        last = tarfile.TarInfo("zz0003.jpg")
        last.size = len(payload)
        t.addfile(last, io.BytesIO(payload))
    with tarfile.open(path) as t:
        cut = t.getmember("zz0003.jpg").offset_data + len(payload) // 2
    with open(path, "r+b") as f:  # truncated in the last member's data: the tar's end gone too
        f.truncate(cut)
    m, reasons = _built_with_skips(raw, tmp_path / "out")
    assert "decompression bomb" in reasons["train-000000.tar:zz0000"]
    assert "symlink member" in reasons["train-000000.tar:zz0001.jpg"]
    assert "FIFO member" in reasons["train-000000.tar:zz0002.jpg"]
    assert "truncated" in reasons["train-000000.tar:zz0003.jpg"]
    assert m.counts["packed"] == len(_samples(photos)) and m.counts["found"] == m.counts["packed"] + m.counts["skipped"]


def test_packer_info_names_the_input_form_and_its_fields(photos, tmp_path, capsys):
    raw = _hf(photos, tmp_path / "hf")
    assert main(["build", str(raw), str(tmp_path / "out"), *SIZE]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "out")]) == 0
    assert "input     parquet (image: image, label: label)" in capsys.readouterr().out


def test_images_whose_transparency_is_dropped_are_counted_in_the_summary(photos, tmp_path, capsys):
    from PIL import Image

    raw = tmp_path / "alpha"
    (raw / "a").mkdir(parents=True)
    Image.new("RGBA", (40, 30), (10, 20, 30, 90)).save(raw / "a" / "see-through.png")
    Image.new("RGBA", (40, 30), (10, 20, 30, 255)).save(raw / "a" / "opaque-alpha.png")
    Image.new("RGB", (40, 30), (10, 20, 30)).save(raw / "a" / "plain.png")
    assert main(["build", str(raw), str(tmp_path / "out"), "--image-size", "16"]) == 0
    assert "1 image had transparency" in capsys.readouterr().out
    assert MMapDataset(tmp_path / "out").manifest.build["flattened"] == 1
    assert main(["build", str(raw), str(tmp_path / "bg"), "--image-size", "16", "--background", "255,255,255"]) == 0
    assert "had transparency" not in capsys.readouterr().out


def test_parquet_files_whose_class_names_differ_are_refused_not_mixed(photos, tmp_path, capsys):
    """Label 3 of one file and label 3 of the other would name two classes: the second file's
    labels would land on the first file's names."""
    from datasets import ClassLabel

    raw = _hf(photos, tmp_path / "hf", name="train-00000-of-00002.parquet")
    import pyarrow.parquet as pq

    table = pq.read_table(raw / "data" / "train-00000-of-00002.parquet")
    meta = json.loads(table.schema.metadata[b"huggingface"])
    meta["info"]["features"]["label"] = {"names": list(reversed(_classes(photos))), "_type": ClassLabel.__name__}
    pq.write_table(table.replace_schema_metadata({b"huggingface": json.dumps(meta).encode()}),
                   raw / "data" / "train-00001-of-00002.parquet")
    err = one_line_error(capsys, ["build", str(raw), str(tmp_path / "out"), *SIZE])
    assert "ClassLabel names are not" in err and "train-00001-of-00002.parquet" in err
    # the command a user runs scans Parquet in a child process (below): its error is the same line
    run = subprocess.run([sys.executable, "-m", "packer", "build", str(raw), str(tmp_path / "out2"), *SIZE],
                         capture_output=True, text=True)
    assert run.returncode != 0 and run.stderr.count("\n") == 1 and "ClassLabel names are not" in run.stderr


def test_a_parquet_build_reads_parquet_in_a_child_so_that_it_forks_its_workers(photos, tmp_path):
    """pyarrow starts threads as it is imported, after which the build process could only start
    its workers from a forkserver (a second or more of each build); the scan reads the Parquet
    files in a forked child of its own and hands back the same records."""
    raw = _hf(photos, tmp_path / "hf")
    code = ("import sys, packer._one_blas_thread  # as `packer build` starts: numpy's OpenBLAS without threads\n"
            "from packer.builder.scan import scan; from packer.builder.pool import start_method\n"
            "if __name__ == '__main__':\n"
            f"    s = scan({str(raw)!r}); print(len(s.records), s.form, 'pyarrow' in sys.modules, start_method(False))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert got == [str(len(_samples(photos))), "parquet", "False", "fork"]


def _abort_quietly() -> None:
    """The child's death by SIGABRT, without pytest's faulthandler printing its stacks into the
    run's log (where an intended abort reads as a crash)."""
    import faulthandler

    faulthandler.disable()
    os.abort()


def test_a_forked_childs_answer_or_death_comes_back():
    from packer.system import ChildDied, in_forked_child

    assert in_forked_child(sorted, [3, 1, 2]) == [1, 2, 3]
    with pytest.raises(ValueError, match="invalid literal"):
        in_forked_child(int, "x")
    with pytest.raises(ChildDied, match="signal 6"):
        in_forked_child(_abort_quietly)
    import multiprocessing  # a daemonic process (a pool's worker) may have no children: it runs there

    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply(in_forked_child, (os.getppid,)) == os.getpid()


def test_a_huge_integer_label_without_class_names_is_an_error_not_a_billion_classes(photos, tmp_path, capsys):
    import webdataset as wds

    raw = tmp_path / "tar"
    raw.mkdir()
    p = _samples(photos)[0][0]
    with wds.TarWriter(str(raw / "train-000000.tar")) as w:
        w.write({"__key__": "000000", p.suffix[1:].lower(): p.read_bytes(), "cls": "999999999999"})
    err = one_line_error(capsys, ["build", str(raw), str(tmp_path / "out"), *SIZE])
    assert "--classes FILE" in err


_MEMBER = st.tuples(
    st.text(st.characters(codec="utf-8", exclude_characters="\0/"), min_size=1, max_size=12),  # a name part
    st.integers(0, 3),  # folders above it
    st.sampled_from([tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE,
                     tarfile.FIFOTYPE, tarfile.CHRTYPE, tarfile.CONTTYPE]),
    st.integers(0, 1500))  # data bytes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(members=st.lists(_MEMBER, max_size=8), fmt=st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT,
                                                                   tarfile.PAX_FORMAT]),
       long_prefix=st.booleans())
def test_the_tar_header_reader_reads_what_tarfile_reads(tmp_path, members, fmt, long_prefix):
    """The scan's own header reader against tarfile's, on tars tarfile writes in its three formats:
    long names (a ustar prefix, GNU long names, pax headers), non-ASCII names, every member type."""
    import io

    from packer.builder.forms.tar import _members

    path = tmp_path / f"t{fmt}.tar"
    with tarfile.open(path, "w", format=fmt, encoding="utf-8") as t:
        for i, (part, depth, kind, size) in enumerate(members):
            name = "/".join([("d" * 60 if long_prefix else "d") + str(k) for k in range(depth)] + [f"{i}{part}"])
            info = tarfile.TarInfo(name + ("/" if kind == tarfile.AREGTYPE and i % 2 else ""))
            info.type = kind
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = "elsewhere"
            if kind in tarfile.REGULAR_TYPES:
                info.size = size
            try:
                t.addfile(info, io.BytesIO(bytes(size)) if kind in tarfile.REGULAR_TYPES else None)
            except ValueError:  # a name this format cannot hold (ustar: over 256 bytes, non-ASCII)
                continue
    with tarfile.open(path, encoding="utf-8") as t:
        want = [(m.name, m.type, m.offset_data, m.size) for m in t]
    with open(path, "rb") as f:
        read = list(_members(f, "t.tar", path.stat().st_size))
    # where tarfile ends quietly (a V7 directory written with data), the reader says so, last
    assert not any(isinstance(m, Skip) for m in read[:-1])
    assert [(m.name, m.type, m.offset_data, m.size) for m in read if not isinstance(m, Skip)] == want


def test_a_damaged_cut_or_joined_tar_says_what_it_did_not_read(photos, tmp_path):
    """tarfile ends quietly at a damaged header, a tar cut at a member's end, or the end blocks of
    the first of two tars joined end to end; each of those is a skip naming the byte here."""
    raw = _tar(photos, tmp_path / "tar")
    good = (raw / "train-000000.tar").read_bytes()
    with tarfile.open(raw / "train-000000.tar") as t:
        members = t.getmembers()
    third = members[6].offset_data - 512  # the fourth sample's first header
    cases = {"damaged": good[:third] + b"\xff" * 512 + good[third + 512:],
             "cut": good[:third],
             "joined": good + good}
    n = len(_samples(photos))
    for case, data in cases.items():
        (raw / "train-000000.tar").write_bytes(data)
        m, reasons = _built_with_skips(raw, tmp_path / f"out-{case}")
        said = [r for k, r in reasons.items() if k.startswith("train-000000.tar:@")]
        assert len(said) == 1, (case, reasons)
        assert {"damaged": "damaged header at byte", "cut": "without its end blocks",
                "joined": "joined end to end"}[case] in said[0]
        assert m.counts["packed"] == (n if case == "joined" else 3)
        assert m.counts["found"] == m.counts["packed"] + m.counts["skipped"]
