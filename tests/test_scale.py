"""Packer at scale: same bytes for any worker count, kill-and-resume, parts + commit, merge,
append, zstd archives, concurrent archive opens, a full disk, progress, Ray."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loaders import MMapDataset
from packer import format as fmt
from packer.archive import materialize
from packer.cli import main
from packer.errors import ManifestError, SourceError
from packer.reader import load_manifest
from packer.system import available_cores

from .procs import kill_mid_build


def _in_shard(path: str) -> str:
    """A file's path from its shard dir on (`shard-k/name`), whatever generation holds it."""
    return "/".join(path.split("/")[-2:])


def tree(out: Path) -> dict[str, str]:
    """Every shard file of a dataset dir -> sha256, and the manifest without its build timings
    and generation name (what two builds of the same bytes share)."""
    doc = json.loads((out / fmt.MANIFEST_NAME).read_text())
    paths = [f["path"] for s in doc["shards"] for f in s["files"]]
    assert paths and all((out / p).is_file() for p in paths)
    files = {_in_shard(p): hashlib.sha256((out / p).read_bytes()).hexdigest() for p in paths}
    doc.pop("build")
    doc.pop("generation")
    inputs = doc.pop("inputs")  # RAW's file table: its bytes, not where it lies (an archive has none)
    if inputs:
        files[fmt.INPUTS_NAME] = hashlib.sha256((out / inputs["path"]).read_bytes()).hexdigest()
    for shard in doc["shards"]:
        for f in shard["files"]:
            f["path"] = _in_shard(f["path"])
    return {"files": files, "manifest": doc}


def by_key(out: Path) -> dict[str, tuple]:
    """Samples keyed by their record key, labels as class names: comparable across datasets."""
    ds = MMapDataset(out)
    classes = ds.classes
    rows = {}
    for i in range(len(ds)):
        s = ds[i]
        label = classes[int(s["label"])] if "label" in s else None
        rows[s["key"]] = (label, *(s[c].numpy().tobytes() for c in ("image", "tokens") if c in s))
    assert len(rows) == len(ds)
    return rows


def build(raw, out, *extra) -> None:
    assert main(["build", str(raw), str(out), "-q", *map(str, extra)]) == 0


IMG = ("--image-size", "32", "--shard-size", "8")


def test_same_bytes_for_any_number_of_workers(tmp_path, image_raw, text_raw, minilm):
    for n in (1, 2, 3):
        build(image_raw, tmp_path / f"img{n}", *IMG, "--workers", n)
    assert tree(tmp_path / "img1") == tree(tmp_path / "img2") == tree(tmp_path / "img3")
    # cores kept busy (informational, for bench packer): one per image-decoding process, at most all
    assert [load_manifest(tmp_path / f"img{n}").build["cores_used"] for n in (1, 2, 3)] == [
        min(n, available_cores()) for n in (1, 2, 3)]
    text = ("--tokenizer", minilm, "--append-eos", "--shard-size", "16KB")
    for n in (1, 2):
        build(text_raw, tmp_path / f"txt{n}", *text, "--workers", n)
    assert tree(tmp_path / "txt1") == tree(tmp_path / "txt2")
    assert load_manifest(tmp_path / "txt1").build["cores_used"] == available_cores()  # tokenizer threads
    # big JSONL files were cut into line ranges: some shard starts inside a file
    ds = MMapDataset(tmp_path / "txt2")
    firsts = [ds[end]["key"] for end in [0, *ds.reader.shard_ends[:-1]]]
    assert any(k.endswith(".jsonl:" + k.rsplit(":", 1)[1]) and not k.endswith(":1") for k in firsts if ".jsonl:" in k)


def test_image_rows_are_hashed_where_they_are_written_not_read_back(tmp_path, image_raw, monkeypatch):
    """Rows of 32 KiB and more are checksum blocks of their own: the processes decoding a
    shard's pieces hash each row as they write it, and the shard's close combines those digests
    (skipped records' rows squeezed out) instead of reading image.npy back. The checksums are
    those of a 1-worker build, which reads every file back, and `packer verify` agrees."""
    from packer import writer

    size = ("--image-size", "112", "--shard-size", "8")  # 112 x 112 x 3 = 37,632 bytes a row
    build(image_raw, tmp_path / "one", *size, "--workers", 1)
    read_back = []
    checksum_file = writer.checksum_file
    monkeypatch.setattr(writer, "checksum_file", lambda path: read_back.append(path.name) or checksum_file(path))
    build(image_raw, tmp_path / "two", *size, "--workers", 2)
    assert tree(tmp_path / "two") == tree(tmp_path / "one")
    assert read_back and "image.npy" not in read_back  # labels and keys are still read back
    m = load_manifest(tmp_path / "two")
    assert m.counts["skipped"] > 0 and any(s.num_samples < 8 for s in m.shards[:-1])  # rows were squeezed
    monkeypatch.undo()
    assert main(["verify", str(tmp_path / "two")]) == 0


@pytest.mark.parametrize("workers", [1, 2])  # shards closed on a thread / image pieces in a pool
@pytest.mark.parametrize("group", [False, True], ids=["parent-only", "whole-group"])
def test_killed_build_resumes_to_the_same_dataset(tmp_path, image_raw, workers, group):
    args = ["--image-size", "96", "--shard-size", "4", "--workers", str(workers)]
    build(image_raw, tmp_path / "clean", *args)
    out = tmp_path / "resumed"
    kill_mid_build(image_raw, out, args, settle=False, group=group)  # resumed while the old workers may still run
    staging = out / fmt.STAGING_DIR
    generation = json.loads((staging / "plan.json").read_text())["generation"]
    whole = sorted(p.name[:-5] for p in staging.glob("shard-*.json"))
    inode = (out / generation / whole[0] / "image.npy").stat().st_ino
    with pytest.raises(ManifestError, match="incomplete build"):
        MMapDataset(out)
    build(image_raw, out, *args)
    assert tree(out) == tree(tmp_path / "clean")
    assert (out / generation / whole[0] / "image.npy").stat().st_ino == inode  # reused, not rewritten


def test_resume_refuses_changed_arguments_or_inputs(tmp_path, image_raw, capsys):
    raw = tmp_path / "raw"
    shutil.copytree(image_raw, raw, symlinks=True)
    out = tmp_path / "out"
    args = ["--image-size", "96", "--shard-size", "4", "--workers", "2"]
    kill_mid_build(raw, out, args)
    assert main(["build", str(raw), str(out), "-q", "--image-size", "64", "--shard-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "unfinished build" in err and "image_size 96 (now 64)" in err and err.count("\n") == 1
    victim = next(raw.glob("*/*.jpg"))
    victim.write_bytes(victim.read_bytes() + b"\0")
    assert main(["build", str(raw), str(out), "-q", *args]) == 2
    assert "RAW has changed" in capsys.readouterr().err
    build(raw, out, *args, "--overwrite")
    assert len(MMapDataset(out)) > 0


def test_parts_then_commit(tmp_path, image_raw, capsys):
    build(image_raw, tmp_path / "clean", *IMG)
    out = tmp_path / "parts"
    for i in (2, 0):
        assert main(["build", str(image_raw), str(out), "-q", *IMG, "--part", f"{i}/3"]) == 0
    assert "part 0/3" in capsys.readouterr().out
    assert main(["commit", str(out)]) == 2
    assert "not built yet" in capsys.readouterr().err
    assert not (out / fmt.MANIFEST_NAME).exists()
    assert main(["build", str(image_raw), str(out), "-q", *IMG, "--part", "1/3"]) == 0
    staged = tmp_path / "staged"
    shutil.copytree(out / fmt.STAGING_DIR, staged)
    assert main(["commit", str(out)]) == 0
    assert tree(out) == tree(tmp_path / "clean")
    assert main(["build", str(image_raw), str(out), "-q", *IMG, "--part", "3/3"]) == 2
    # a commit killed after its publish, while it removed the staging: plan.json left, sidecars gone
    (out / fmt.STAGING_DIR).mkdir()
    shutil.copy(staged / "plan.json", out / fmt.STAGING_DIR / "plan.json")
    capsys.readouterr()
    assert main(["commit", str(out)]) == 0, capsys.readouterr().err  # said "3 of 10 shards are not built yet"
    assert tree(out) == tree(tmp_path / "clean") and not (out / fmt.STAGING_DIR).exists()


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


def test_merge_and_append_equal_a_build_of_the_union(tmp_path, image_raw):
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
    build(union, appended, *IMG, "--append")
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


def test_pack_unpack_round_trip_and_a_damaged_byte(tmp_path, built, capsys):
    src = built["images"]
    assert main(["pack", str(src), str(tmp_path / "arc"), "--level", "9"]) == 0
    assert "ratio" in capsys.readouterr().out
    assert main(["unpack", str(tmp_path / "arc"), str(tmp_path / "back")]) == 0
    src_tree = tree(src)
    del src_tree["files"][fmt.INPUTS_NAME]
    assert tree(tmp_path / "back") == src_tree
    victim = next((tmp_path / "arc").rglob("shard-*/image.npy.zst"))
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    victim.write_bytes(bytes(raw))
    assert main(["unpack", str(tmp_path / "arc"), str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    assert victim.name in err and err.count("\n") == 1
    assert not (tmp_path / "bad" / fmt.MANIFEST_NAME).exists()


def _open_archive(args) -> tuple[str, bool, int]:
    archive, cache = args
    path, unpacked = materialize(archive, cache)
    return str(path), unpacked, len(MMapDataset(archive, cache_dir=cache))


def test_concurrent_first_opens_of_an_archive_unpack_once(tmp_path, built):
    assert main(["pack", str(built["text"]), str(tmp_path / "arc")]) == 0
    cache = tmp_path / "cache"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        got = pool.map(_open_archive, [(str(tmp_path / "arc"), str(cache))] * 4)
    assert len({path for path, _, _ in got}) == 1
    assert sum(unpacked for _, unpacked, _ in got) == 1
    assert {n for _, _, n in got} == {len(MMapDataset(built["text"]))}
    ds = MMapDataset(tmp_path / "arc", cache_dir=cache)
    ref = MMapDataset(built["text"])
    assert np.array_equal(ds[3]["tokens"].numpy(), ref[3]["tokens"].numpy())


_FULL_DISK = r"""
import json, os, subprocess, sys
from pathlib import Path
raw, mnt, filler_bytes, args = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
from packer import load_manifest
report = {}
for workers in ("1", "2"):
    out, filler = mnt / f"ds{workers}", mnt / "filler"
    filler.write_bytes(b"\0" * filler_bytes)  # tmpfs: really takes the space
    cmd = [sys.executable, "-m", "packer.cli", "build", raw, str(out), "-q", *args, "--workers", workers]
    full = subprocess.run(cmd, capture_output=True, text=True)
    try:
        load_manifest(out)
        loads = True
    except Exception:
        loads = False
    state = {"rc": full.returncode, "stderr": full.stderr, "loads": loads,
             "partials": sorted(p.name for p in (out / ".staging").glob("*.partial"))}
    filler.unlink()  # space freed: the same command resumes
    again = subprocess.run(cmd, capture_output=True, text=True)
    state.update(rc_again=again.returncode, stderr_again=again.stderr,
                 files={p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.glob("shard-*/*"))})
    report[workers] = state
    subprocess.run(["rm", "-rf", str(out)], check=True)
print(json.dumps(report))
"""


def _private_tmpfs_works(mnt: Path) -> bool:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=1m mmpack-probe "$1"', "sh",
                            str(mnt)], capture_output=True)
    return probe.returncode == 0


def test_full_disk_is_one_line_and_leaves_no_dataset(tmp_path, image_raw):
    """A real full disk: a small tmpfs mounted in a private mount namespace (`unshare -rm`, no
    root needed where user namespaces are allowed), a filler file taking most of it."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    if not _private_tmpfs_works(mnt):
        pytest.skip("needs Linux with unshare and user namespaces to mount a small tmpfs")
    ref = tmp_path / "ref"
    build(image_raw, ref, *IMG, "--workers", "1")
    need = sum(p.stat().st_size for p in ref.rglob("*") if p.is_file())
    disk = 2 * need + (1 << 20)  # room for the dataset twice over, once the filler is gone
    filler = disk - need // 2  # the first build finds half the space it needs
    shell = 'mount -t tmpfs -o size="$1" mmpack-test "$2" && shift 2 && exec "$@"'
    res = subprocess.run(["unshare", "-rm", "sh", "-c", shell, "sh", str(disk), str(mnt), sys.executable, "-c",
                          _FULL_DISK, str(image_raw), str(mnt), str(filler), *IMG],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    want = {p.relative_to(ref).as_posix(): p.stat().st_size for p in sorted(ref.glob("shard-*/*"))}
    for workers, state in report.items():
        err = state["stderr"]
        assert state["rc"] == 2, (workers, err)
        assert err.count("\n") == 1 and "No space left on device" in err and "Traceback" not in err, err
        assert f"small-disk/ds{workers}/.staging/" in err, err  # names the file it could not write
        assert not state["loads"] and state["partials"] == [], state
        assert state["rc_again"] == 0, state["stderr_again"]
        assert state["files"] == want  # the resumed build is the whole dataset


def test_overwrite_waits_for_a_killed_builds_last_writer(tmp_path, image_raw):
    """--overwrite deletes an unfinished build of other arguments, but not under a worker of the
    killed build that is still finishing its shard: it waits for that shard's lock first."""
    import threading

    from packer import builder, shards

    out = tmp_path / "out"
    old = builder._prepare(builder.BuildConfig(image_raw, out, image_size=32, shard_rows=8, shard_bytes=None,
                                               workers=1))
    rc = {}
    with shards.shard_lock(old.ctx.staging, 1):  # "the killed build's worker", still writing shard 1
        runner = threading.Thread(target=lambda: rc.update(rc=main(["build", str(image_raw), str(out), "-q",
                                                                     "--image-size", "16", "--shard-size", "8",
                                                                     "--workers", "1", "--overwrite"])))
        runner.start()
        runner.join(timeout=1.0)
        assert runner.is_alive(), "--overwrite did not wait for the shard's lock"
        assert (old.ctx.staging / builder.PLAN_FILE).exists()  # the old build's staging is still there
    runner.join(timeout=60)
    assert rc == {"rc": 0} and MMapDataset(out)[0]["image"].shape == (16, 16, 3)


def test_a_close_that_fails_while_the_next_shard_fills_drops_both(tmp_path, image_raw, capsys, monkeypatch):
    """One process closes shard k on a thread while it fills shard k+1: when that close fails
    (a full disk at its fsync), the filled shard k+1 is dropped too and its lock released."""
    import errno
    import fcntl

    from packer import writer

    close = writer.ShardWriter.close

    def failing(self):
        if self.index == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.dir / "image.npy"))
        return close(self)

    monkeypatch.setattr(writer.ShardWriter, "close", failing)
    out = tmp_path / "out"
    assert main(["build", str(image_raw), str(out), *IMG, "--workers", "1", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "shard-00001" in err, err
    staging = out / fmt.STAGING_DIR
    generation = out / json.loads((staging / "plan.json").read_text())["generation"]
    assert not list(staging.glob("*.partial")) and not (out / fmt.MANIFEST_NAME).exists()
    assert (generation / "shard-00000").is_dir() and not (generation / "shard-00002").exists()  # 2 was filled, dropped
    for lock in staging.glob("*.lock"):
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while a lock is held


def test_a_text_shard_that_fails_mid_way_leaves_no_encoder_running(tmp_path, text_raw, minilm, monkeypatch):
    """Text batches are encoded on threads ahead of the writer: a write that fails (a full disk)
    part-way through a shard drops the shard and returns only once no encoder thread is left
    and no further batch was started (the shard function, in this process)."""
    import errno
    import threading

    from packer import builder, shards, text, writer

    add, encode, calls, at_failure = writer.ShardWriter.add, text.encode_batch, [], []

    def failing(self, sample):
        if self.num_samples == 5:  # a few batches in, with the next ones encoding
            at_failure.append(len(calls))
            raise OSError(errno.ENOSPC, "No space left on device", str(self.dir / "tokens.npy"))
        return add(self, sample)

    def counted(*args, **kwargs):
        calls.append(len(calls))
        return encode(*args, **kwargs)

    monkeypatch.setattr(writer.ShardWriter, "add", failing)
    monkeypatch.setattr(text, "encode_batch", counted)
    monkeypatch.setattr(text, "TOKENIZE_BATCH_DOCS", 2)
    prep = builder._prepare(builder.BuildConfig(text_raw, tmp_path / "out", tokenizer=minilm, workers=1))
    task = prep.plan.tasks[0]
    with pytest.raises(OSError, match="No space left on device"):
        shards.run_shard(prep.ctx, task, list(builder.records_of(prep.found, task)))
    assert not [t for t in threading.enumerate() if t.name.startswith("mmpack-encode")]
    assert len(calls) - at_failure[0] <= text.ENCODE_AHEAD  # only batches already submitted ran after it
    assert not list(prep.ctx.staging.glob("*.partial")) and not list(prep.ctx.staging.glob("*.busy"))
    with shards.shard_lock(prep.ctx.staging, task.index):  # released
        pass


def test_many_batches_in_flight_are_written_in_order(tmp_path, text_raw, minilm, monkeypatch):
    """The tokenizer pipeline gives the samples of a shard in their order whatever the batch
    size, so with many batches in flight too (batches of 2 against the default)."""
    from packer import builder, shards, text

    def shard_rows(out):
        prep = builder._prepare(builder.BuildConfig(text_raw, out, tokenizer=minilm, workers=1))
        task = prep.plan.tasks[0]
        shard, skipped, items = shards._fill(prep.ctx, task, list(builder.records_of(prep.found, task)))
        result = shards.finish(prep.ctx, task.index, shard, skipped, items)
        files = sorted((out / fmt.shard_path(prep.ctx.generation, task.index)).iterdir())
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}, result.skipped

    whole = shard_rows(tmp_path / "whole")
    monkeypatch.setattr(text, "TOKENIZE_BATCH_DOCS", 2)
    assert shard_rows(tmp_path / "pairs-of-2") == whole


def test_a_full_disk_at_the_crash_trace_files_names_them(tmp_path, image_raw, text_raw, minilm, monkeypatch):
    """The files that trace a dying worker to its item (a piece's, a whole shard's) are
    written with pwrite, whose ENOSPC names no file: the error names them (a full
    disk at the first such write was the one-in-twenty failure of the full-disk test)."""
    import errno

    from packer import builder, pieces, shards

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    prep = builder._prepare(builder.BuildConfig(image_raw, tmp_path / "img", image_size=32, shard_rows=8,
                                                shard_bytes=None, workers=2))
    task = prep.plan.tasks[0]
    assert pieces.open_pieces(prep.ctx, task) is None
    records = [r for _, r in builder.records_of(prep.found, task)]
    with pytest.raises(OSError) as caught:
        pieces.run_piece(prep.ctx, task.index, 0, records)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename.endswith("shard-00000.0.busy")
    prep = builder._prepare(builder.BuildConfig(text_raw, tmp_path / "txt", tokenizer=minilm, workers=1))
    task = prep.plan.tasks[0]
    with pytest.raises(OSError) as caught:
        shards.run_shard(prep.ctx, task, list(builder.records_of(prep.found, task)))
    assert caught.value.errno == errno.ENOSPC and caught.value.filename.endswith("shard-00000.busy")
    assert not list(prep.ctx.staging.glob("*.partial")) and not list(prep.ctx.staging.glob("*.busy"))


def test_progress_lines_into_a_pipe(tmp_path, image_raw, capsys, monkeypatch):
    from packer import cli

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(cli.ProgressBar, "LINE_EVERY_S", 0.0)
    assert main(["build", str(image_raw), str(tmp_path / "a"), *IMG, "--workers", "2"]) == 0
    err = capsys.readouterr().err
    assert "packing:" in err and "records" in err and "ETA" in err
    assert main(["build", str(image_raw), str(tmp_path / "b"), *IMG, "--quiet"]) == 0
    assert "packing:" not in capsys.readouterr().err
    monkeypatch.setenv("CI", "true")
    assert main(["build", str(image_raw), str(tmp_path / "c"), *IMG]) == 0
    assert "packing:" not in capsys.readouterr().err


def test_ray_engine_gives_the_same_dataset(tmp_path, image_raw):
    pytest.importorskip("ray")
    build(image_raw, tmp_path / "local", *IMG)
    build(image_raw, tmp_path / "ray", *IMG, "--engine", "ray")
    assert tree(tmp_path / "ray") == tree(tmp_path / "local")


@pytest.mark.parametrize("piece_rows", [3, 32])
def test_image_shards_in_pieces_give_the_bytes_of_one_worker(tmp_path, image_raw, monkeypatch, piece_rows):
    """A pool splits each image shard into pieces that any worker decodes into the shard's slots;
    skipped records' slots are squeezed out at the end. Shards of 40 rows, pieces of 3 (1 to 3
    in the last shard): skips land inside pieces, at piece edges and in whole pieces of other
    workers."""
    from packer import pieces

    monkeypatch.setattr(pieces, "PIECE_ROWS", piece_rows)
    monkeypatch.setattr(pieces, "MIN_PIECE_ROWS", min(piece_rows, pieces.MIN_PIECE_ROWS) // 2)
    args = ("--image-size", "32", "--shard-size", "40")
    build(image_raw, tmp_path / "one", *args, "--workers", 1)
    build(image_raw, tmp_path / "pieces", *args, "--workers", 3)
    assert tree(tmp_path / "pieces") == tree(tmp_path / "one")
    m = load_manifest(tmp_path / "one")
    assert m.counts["skipped"] > 0 and len(m.shards) > 1 and max(s.num_samples for s in m.shards) > piece_rows


@given(rows=st.integers(0, 5000), last=st.booleans(), lanes=st.integers(1, 64))
def test_pieces_cover_a_shard_and_shrink_only_towards_the_builds_end(rows, last, lanes):
    """Pieces tile the shard's rows in order; PIECE_ROWS each, except the build's last shard,
    whose pieces never grow, never fall below MIN_PIECE_ROWS (but for the remainder) and end
    small enough that lanes finishing together wait at most a small piece for each other."""
    from packer.pieces import MIN_PIECE_ROWS, PIECE_ROWS, piece_bounds

    bounds = piece_bounds(rows, last=last, lanes=lanes)
    assert [first for first, _ in bounds] == [0, *(stop for _, stop in bounds)][:len(bounds)]
    assert (bounds[-1][1] if bounds else 0) == rows
    sizes = [stop - first for first, stop in bounds]
    assert all(0 < size <= PIECE_ROWS for size in sizes)
    if not last:
        assert all(size == PIECE_ROWS for size in sizes[:-1])
    else:  # at most 1 / (2 x lanes) of what is left, within [MIN_PIECE_ROWS, PIECE_ROWS]: never growing
        assert all(stop - first <= max(MIN_PIECE_ROWS, (rows - first) // (2 * lanes)) for first, stop in bounds)
        assert all(size >= MIN_PIECE_ROWS for size in sizes[:-1]) and sizes == sorted(sizes, reverse=True)


@given(n=st.integers(0, 3000), size=st.integers(1, 64), rows=st.none() | st.integers(1, 500),
       nbytes=st.none() | st.integers(1, 2_000_000))
def test_fixed_size_images_are_planned_as_one_image_at_a_time_would_be(n, size, rows, nbytes):
    """Images of one output size are planned a run of records at a time: the same shards as
    the record-by-record cut that sizes vary with ('keep')."""
    from packer import plan as planning
    from packer.sources import Record, Scan

    if rows is None and nbytes is None:
        rows = 100
    found = Scan("images", tuple(Record(f"c/{i}.jpg", f"/nowhere/c/{i}.jpg", label=0) for i in range(n)), ())
    fast = planning.plan(found, image_size=size, token_itemsize=2, shard_rows=rows, shard_bytes=nbytes)
    cutter = planning._Cutter(rows, nbytes, 0)
    for i in range(n):
        cutter.add(planning.Span(i), 1, planning._image_bytes(None, size))
    cutter.cut()
    assert fast.tasks == tuple(cutter.tasks)


def test_only_the_last_shards_pieces_start_their_writeback_early(tmp_path, image_raw):
    """The build's last fsync is time in which no core decodes, so the last shard's pieces have
    the kernel start writing their rows at once; the other shards' rows are left to their fsync,
    which runs beside decoding. Pieces still give the bytes of a one-worker build."""
    from concurrent.futures import ThreadPoolExecutor

    from packer import builder, engines

    config = builder.BuildConfig(image_raw, tmp_path / "out", image_size=32, shard_rows=8, shard_bytes=None,
                                 workers=1)
    prep = builder._prepare(config)
    jobs = [(task, list(builder.records_of(prep.found, task))) for task in prep.plan.tasks]
    calls = []

    class Recording(ThreadPoolExecutor):
        def submit(self, fn, *args, **kwargs):
            if fn is engines.run_piece:
                calls.append((args[1], kwargs["writeback"]))  # (shard index, writeback)
            return super().submit(fn, *args, **kwargs)

    with Recording(2) as pool:
        results = engines._Scheduler(pool, prep.ctx, iter(jobs), 2, lambda: None, lambda n: None).run()
    last = prep.plan.tasks[-1].index
    assert len(prep.plan.tasks) > 2 and {i for i, _ in calls} == {t.index for t in prep.plan.tasks}
    assert all(early == (index == last) for index, early in calls)
    builder.commit(config.out)
    build(image_raw, tmp_path / "one", "--image-size", "32", "--shard-size", "8", "--workers", 1)
    assert tree(config.out) == tree(tmp_path / "one") and len(results) == len(jobs)


def test_a_failing_piece_leaves_no_shard_half_done_even_one_waiting_for_its_finish(tmp_path, image_raw, monkeypatch):
    """A piece that fails (a full disk) ends the build with no partial shard dir: neither the
    shards still in pieces nor those whose finish was queued behind a slow one (cancelled); the
    finish that was running ends whole, for the resume."""
    import errno
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from packer import builder, engines

    config = builder.BuildConfig(image_raw, tmp_path / "out", image_size=32, shard_rows=8, shard_bytes=None,
                                 workers=1)
    prep = builder._prepare(config)
    tasks = prep.plan.tasks
    jobs = [(task, list(builder.records_of(prep.found, task))) for task in tasks]
    release, finish, run_piece = threading.Event(), engines.finish_pieces, engines.run_piece

    def slow_first_finish(ctx, task, *args):
        if task.index == tasks[0].index:
            release.wait(30)
        return finish(ctx, task, *args)

    def failing_piece(ctx, index, *args, **kwargs):
        if index == tasks[5].index:  # by now the finishes of shards 1-4 wait behind the first one
            time.sleep(1)
            threading.Timer(1, release.set).start()
            raise OSError(errno.ENOSPC, "No space left on device")
        return run_piece(ctx, index, *args, **kwargs)

    monkeypatch.setattr(engines, "finish_pieces", slow_first_finish)
    monkeypatch.setattr(engines, "run_piece", failing_piece)
    with ThreadPoolExecutor(2) as pool, pytest.raises(OSError, match="No space"):
        engines._Scheduler(pool, prep.ctx, iter(jobs), 2, lambda: None, lambda n: None).run()
    staging = tmp_path / "out" / fmt.STAGING_DIR
    assert len(tasks) > 6 and sorted(p.name for p in staging.glob("*.partial")) == []
    assert (tmp_path / "out" / prep.ctx.generation / fmt.shard_dir_name(tasks[0].index) / "image.npy").is_file()  # the running finish ended whole


def test_a_shard_that_fails_to_open_leaves_no_partial_dir(tmp_path, image_raw, monkeypatch):
    """The disk can fill up while a shard's slots file is made, after its partial dir exists."""
    import errno
    from concurrent.futures import ThreadPoolExecutor

    from packer import builder, engines, writer

    config = builder.BuildConfig(image_raw, tmp_path / "out", image_size=32, shard_rows=8, shard_bytes=None,
                                 workers=1)
    prep = builder._prepare(config)
    jobs = [(task, list(builder.records_of(prep.found, task))) for task in prep.plan.tasks]
    open_pieces = engines.open_pieces

    def full_disk_at_the_third(ctx, task):
        if task.index == prep.plan.tasks[2].index:
            writer.partial_dir(ctx.staging, task.index, fresh=True)
            raise OSError(errno.ENOSPC, "No space left on device")
        return open_pieces(ctx, task)

    monkeypatch.setattr(engines, "open_pieces", full_disk_at_the_third)
    with ThreadPoolExecutor(2) as pool, pytest.raises(OSError, match="No space"):
        engines._Scheduler(pool, prep.ctx, iter(jobs), 2, lambda: None, lambda n: None).run()
    assert sorted(p.name for p in (tmp_path / "out" / fmt.STAGING_DIR).glob("*.partial")) == []


def test_start_writeback_keeps_the_bytes_and_is_found_on_linux(tmp_path):
    from packer import writer

    if sys.platform.startswith("linux"):
        assert writer._sync_file_range() is not None  # else the last shard's early writeback is silently gone
    path = tmp_path / "f"
    data = os.urandom(1 << 20)
    path.write_bytes(data)
    fd = os.open(path, os.O_WRONLY)
    try:
        writer.start_writeback(fd, 4096, len(data))  # past the end too: no error
    finally:
        os.close(fd)
    assert path.read_bytes() == data


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_pool_worker_asks_to_be_killed_with_its_parent():
    """So that a `kill -9` of the build leaves no worker writing into its staging dir."""
    code = ("import ctypes, signal; from packer.workers import _die_with_parent; _die_with_parent(); "
            "sig = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(sig)); "  # PR_GET_PDEATHSIG
            "print(sig.value == signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_with_last_marks_only_the_last_item():
    from packer.engines import _with_last

    assert list(_with_last(iter([]))) == []
    assert list(_with_last(iter("a"))) == [("a", True)]
    assert list(_with_last(iter("abc"))) == [("a", False), ("b", False), ("c", True)]


def test_a_shard_being_written_elsewhere_is_waited_for_then_reused(tmp_path, image_raw):
    """A killed build's worker may still be finishing a shard when the build is started again:
    the new run waits on the shard's lock instead of writing the same files at the same time,
    then reuses the shard if the other run finished it."""
    import threading

    from packer import builder, shards

    config = builder.BuildConfig(image_raw, tmp_path / "out", image_size=32, shard_rows=8, shard_bytes=None,
                                 workers=1)
    prep = builder._prepare(config)
    task = prep.plan.tasks[0]
    records = list(builder.records_of(prep.found, task))
    staging = prep.ctx.staging
    got = {}
    with shards.shard_lock(staging, task.index):  # "the old run's worker", still writing shard 0
        runner = threading.Thread(target=lambda: got.update(first=shards.run_shard(prep.ctx, task, records)))
        runner.start()
        runner.join(timeout=1.0)
        assert runner.is_alive(), "run_shard did not wait for the shard's lock"
        assert not (staging / "shard-00000.partial").exists() and not shards.sidecar_path(staging, 0).exists()
        old = shards.finish(prep.ctx, task.index, *shards._fill(prep.ctx, task, records))  # the old run finishes it
    runner.join(timeout=60)
    assert not runner.is_alive()
    assert got["first"].reused and got["first"].shard == old.shard


@pytest.mark.parametrize("workers", [1, 2])  # read ahead in the decoding loop / pieces at submission
def test_every_input_is_prefetched_once_before_it_is_decoded(tmp_path, image_raw, monkeypatch, workers):
    """Cold inputs are read while earlier ones decode (posix_fadvise WILLNEED): each record's
    file is prefetched once, whichever way the build runs. (The speed-up on cold inputs is a
    benchmark figure, not a test.)"""
    from packer import engines, sources

    seen = []
    prefetch = sources.prefetch

    def recording(records):
        records = list(records)
        seen.extend(r.key for r in records)
        prefetch(records)

    monkeypatch.setattr(sources, "prefetch", recording)
    monkeypatch.setattr(engines, "prefetch", recording)
    build(image_raw, tmp_path / "out", *IMG, "--workers", workers)
    assert sorted(seen) == sorted(r.key for r in sources.scan(image_raw).records)


def _blas_threads_setting() -> str | None:
    return os.environ.get("OPENBLAS_NUM_THREADS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc/self/task are Linux's here")
def test_workers_fork_only_from_a_single_thread_and_never_for_a_tokenizer():
    """A fork copies no lock that another thread holds only where there is no other thread; a
    build with a tokenizer never forks (its Rust pool can deadlock the child)."""
    code = ("import threading, packer.cli; from packer.engines import start_method; "
            "a = start_method(tokenizer=False), start_method(tokenizer=True); "
            "e = threading.Event(); t = threading.Thread(target=e.wait); t.start(); "
            "b = start_method(tokenizer=False); e.set(); t.join(); print(*a, b)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["fork", "forkserver", "forkserver"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc/self/task are Linux's here")
@pytest.mark.parametrize("workers", [2, 3])
def test_an_image_build_forked_from_the_command_gives_the_same_bytes(tmp_path, image_raw, workers):
    """The `packer` command runs one thread, so its image pool forks: every worker before any
    thread of the pool starts, with the same bytes as one worker (the in-process builds of the
    other tests go through the forkserver wherever pytest runs more than one thread, as it does
    here with numpy's OpenBLAS threads)."""
    build(image_raw, tmp_path / "one", *IMG, "--workers", 1)
    argv = ["build", str(image_raw), str(tmp_path / "forked"), "-q", *IMG, "--workers", str(workers)]
    code = ("import os, sys, packer.cli; forks = []; "
            "os.register_at_fork(before=lambda: forks.append(len(os.listdir('/proc/self/task')))); "
            f"rc = packer.cli.main({argv!r}); print(forks); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == [1] * workers  # threads at each fork
    assert tree(tmp_path / "forked") == tree(tmp_path / "one")


def test_the_collector_skips_the_scan_then_its_objects_and_is_restored(tmp_path, image_raw, monkeypatch):
    """The scan and plan run with the cyclic collector off (a third of the time to prepare
    100,000 files went to its passes); the shards are built with the scan's objects frozen out
    of it; afterwards it is as it was, after a user error too, and off if the caller had it off."""
    import gc

    from packer import builder, engines

    seen = []
    scan, run = builder.scan, engines.run_pool
    monkeypatch.setattr(builder, "scan", lambda *a: (seen.append(("scan", gc.isenabled())), scan(*a))[1])
    frozen = gc.get_freeze_count()  # some interpreters (a distribution's) start with objects frozen
    monkeypatch.setattr(engines, "run_pool",
                        lambda *a: (seen.append(("run", gc.get_freeze_count() > frozen)), run(*a))[1])
    assert gc.isenabled()
    builder.build(builder.BuildConfig(image_raw, tmp_path / "out", image_size=32, workers=1))
    # (an interpreter that starts with objects frozen keeps its freeze as it is)
    assert seen == [("scan", False), ("run", frozen == 0)] and gc.isenabled() and gc.get_freeze_count() == frozen
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError):
        builder.build(builder.BuildConfig(tmp_path / "empty", tmp_path / "out2", workers=1))
    assert gc.isenabled()
    gc.disable()
    try:
        builder.build(builder.BuildConfig(image_raw, tmp_path / "out3", image_size=32, workers=1))
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork is Linux's start method here")
def test_forked_workers_leave_the_parents_objects_out_of_their_garbage_collector():
    """A collection in a worker would write to every object the build process holds (a
    million records) and copy their pages into the worker: they are frozen there, not here."""
    code = """
import gc, os
from concurrent.futures import ProcessPoolExecutor
from packer import engines
frozen = gc.get_freeze_count()  # some interpreters (a distribution's) start with objects frozen
held = [[i] for i in range(100_000)]
with ProcessPoolExecutor(1, mp_context=engines._context("fork")) as pool:
    engines._fork_now(pool)
    print(pool.submit(os.getppid).result() == os.getpid(),
          frozen > 0 or pool.submit(gc.get_freeze_count).result() > len(held), gc.get_freeze_count() == frozen)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the forkserver is Linux's start method here")
def test_pool_workers_and_their_server_run_openblas_on_one_thread():
    """The forkserver imports numpy for its workers: with OpenBLAS's default (a thread per core)
    the server's threads spin until its first fork, on a core the build's first lane needs while
    the pool starts. A user's own setting stays."""
    from concurrent.futures import ProcessPoolExecutor

    from packer import engines

    with ProcessPoolExecutor(1, mp_context=engines._context("forkserver")) as pool:
        assert pool.submit(_blas_threads_setting).result() == os.environ.get("OPENBLAS_NUM_THREADS", "1")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads counted in /proc/self/task")
@pytest.mark.parametrize("setting", [None, "2"])
def test_the_packer_command_runs_openblas_on_one_thread_unless_told(setting):
    """The build process never calls BLAS, but numpy's import starts OpenBLAS threads that spin
    for about 0.1 s of a core each, beside the first lane or the tokenizer threads. The command
    sets one thread before numpy is imported (a thread count, so an import moved above it fails
    here on any machine with 2+ cores); a user's own setting stays."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if setting:
        env["OPENBLAS_NUM_THREADS"] = setting
    code = "import os, packer.cli; print(len(os.listdir('/proc/self/task')), os.environ['OPENBLAS_NUM_THREADS'])"
    threads, value = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    check=True).stdout.split()
    assert value == (setting or "1")
    if setting is None:
        assert threads == "1"
