"""The shard function: rows hashed where written, a full disk, failures mid-shard, crash traces,
a shard written elsewhere."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from packer.dataset import format as fmt
from packer.cli import main
from packer.dataset.reader import load_manifest



from ..trees import IMG, build, tree


def test_image_rows_are_hashed_where_they_are_written_not_read_back(tmp_path, image_raw, monkeypatch):
    """Rows of 32 KiB and more are checksum blocks of their own: the processes decoding a
    shard's pieces hash each row as they write it, and the shard's close combines those digests
    (skipped records' rows squeezed out) instead of reading image.npy back. The checksums are
    those of a 1-worker build, which reads every file back, and `packer verify` agrees."""
    from packer.dataset import writer

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


_FULL_DISK = r"""
import json, os, subprocess, sys
from pathlib import Path
raw, mnt, filler_bytes, args = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
from packer import load_manifest
report = {}
for workers in ("1", "2"):
    out, filler = mnt / f"ds{workers}", mnt / "filler"
    filler.write_bytes(b"\0" * filler_bytes)  # tmpfs: really takes the space
    cmd = [sys.executable, "-m", "packer", "build", raw, str(out), "-q", *args, "--workers", workers]
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


def test_a_close_that_fails_while_the_next_shard_fills_drops_both(tmp_path, image_raw, capsys, monkeypatch):
    """One process closes shard k on a thread while it fills shard k+1: when that close fails
    (a full disk at its fsync), the filled shard k+1 is dropped too and its lock released, even
    when its finish was already queued behind the one that failed."""
    import errno
    import fcntl
    import time

    from packer.dataset import writer

    close = writer.ShardWriter.close

    def failing(self):
        if self.index == 1:
            time.sleep(1.0)  # long enough for shard 2's pieces to come back and its finish to queue
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

    from packer.builder import run as builder, shard as shards, text

    from packer.dataset import writer

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
    from packer.builder import run as builder, shard as shards, text

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

    from packer.builder import run as builder, pieces, shard as shards

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


def test_a_shard_that_fails_to_open_leaves_no_partial_dir(tmp_path, image_raw, monkeypatch):
    """The disk can fill up while a shard's slots file is made, after its partial dir exists."""
    import errno
    from concurrent.futures import ThreadPoolExecutor

    from packer.builder import run as builder, pool as engines

    from packer.dataset import writer

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
    from packer.dataset import writer

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


def test_a_shard_being_written_elsewhere_is_waited_for_then_reused(tmp_path, image_raw):
    """A killed build's worker may still be finishing a shard when the build is started again:
    the new run waits on the shard's lock instead of writing the same files at the same time,
    then reuses the shard if the other run finished it."""
    import threading

    from packer.builder import run as builder, shard as shards

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
