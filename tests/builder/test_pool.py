"""The build's pool: the same bytes for any number of workers, on Ray too, image shards in
row ranges, prefetch, start methods, the collector and BLAS threads in workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loaders import MMapDataset
from packer.dataset import format as fmt
from packer.errors import SourceError
from packer.dataset.reader import load_manifest
from packer.system import available_cores



from ..trees import IMG, build, tree


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
    from packer.builder import pieces

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
    from packer.builder.pieces import MIN_PIECE_ROWS, PIECE_ROWS, piece_bounds

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


def test_only_the_last_shards_pieces_start_their_writeback_early(tmp_path, image_raw):
    """The build's last fsync is time in which no core decodes, so the last shard's pieces have
    the kernel start writing their rows at once; the other shards' rows are left to their fsync,
    which runs beside decoding. Pieces still give the bytes of a one-worker build."""
    from concurrent.futures import ThreadPoolExecutor

    from packer.builder import pool as engines, publish, run as builder

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
    publish.commit(config.out)
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

    from packer.builder import run as builder, pool as engines

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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_pool_worker_asks_to_be_killed_with_its_parent():
    """So that a `kill -9` of the build leaves no worker writing into its staging dir."""
    code = ("import ctypes, signal; from packer.builder.workers import _die_with_parent; _die_with_parent(); "
            "sig = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(sig)); "  # PR_GET_PDEATHSIG
            "print(sig.value == signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_with_last_marks_only_the_last_item():
    from packer.builder.pool import _with_last

    assert list(_with_last(iter([]))) == []
    assert list(_with_last(iter("a"))) == [("a", True)]
    assert list(_with_last(iter("abc"))) == [("a", False), ("b", False), ("c", True)]


@pytest.mark.parametrize("workers", [1, 2])  # read ahead in the decoding loop / pieces at submission
def test_every_input_is_prefetched_once_before_it_is_decoded(tmp_path, image_raw, monkeypatch, workers):
    """Cold inputs are read while earlier ones decode (posix_fadvise WILLNEED): each record's
    file is prefetched once, whichever way the build runs. (The speed-up on cold inputs is a
    benchmark figure, not a test.)"""
    from packer.builder import pool as engines, scan as sources

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
    code = ("import packer._one_blas_thread, threading, packer.cli; from packer.builder.pool import start_method; "
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
    code = ("import os, sys; from packer import __main__ as command; forks = []; "
            "os.register_at_fork(before=lambda: forks.append(len(os.listdir('/proc/self/task')))); "
            f"sys.argv = ['packer', *{argv!r}]; rc = command.main(); print(forks); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == [1] * workers  # threads at each fork
    assert tree(tmp_path / "forked") == tree(tmp_path / "one")


def test_the_collector_skips_the_scan_then_its_objects_and_is_restored(tmp_path, image_raw, monkeypatch):
    """The scan and plan run with the cyclic collector off (a third of the time to prepare
    100,000 files went to its passes); the shards are built with the scan's objects frozen out
    of it; afterwards it is as it was, after a user error too, and off if the caller had it off."""
    import gc

    from packer.builder import run as builder, pool as engines

    seen = []
    scan, run = builder.scan, engines.run_pool
    monkeypatch.setattr(builder, "scan", lambda *a, **k: (seen.append(("scan", gc.isenabled())), scan(*a, **k))[1])
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
from packer.builder import pool as engines
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

    from packer.builder import pool as engines

    with ProcessPoolExecutor(1, mp_context=engines._context("forkserver")) as pool:
        assert pool.submit(_blas_threads_setting).result() == os.environ.get("OPENBLAS_NUM_THREADS", "1")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads counted in /proc/self/task")
@pytest.mark.parametrize("setting", [None, "2"])
def test_the_packer_command_runs_openblas_on_one_thread_unless_told(setting):
    """The build process never calls BLAS, but numpy's import starts OpenBLAS threads that spin
    for about 0.1 s of a core each, beside the first lane or the tokenizer threads. The command
    (`packer.__main__`) sets one thread before numpy is imported (a thread count, so an import
    moved above it fails here on any machine with 2+ cores); a user's own setting stays; and
    importing the CLI or the API sets nothing in the importer's environment."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if setting:
        env["OPENBLAS_NUM_THREADS"] = setting
    code = ("import os, sys, types; from packer import __main__ as command; "
            "report = lambda: print(len(os.listdir('/proc/self/task')), os.environ['OPENBLAS_NUM_THREADS']) or 0; "
            "sys.modules['packer.cli'] = types.SimpleNamespace(main=lambda: __import__('numpy') and report()); "
            "sys.exit(command.main())")
    threads, value = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    check=True).stdout.split()
    assert value == (setting or "1")
    if setting is None:
        assert threads == "1"
    code = "import os, packer.cli, packer.api; print(os.environ.get('OPENBLAS_NUM_THREADS'))"
    imported = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert imported.stdout.split() == [setting or "None"]


def test_a_build_from_a_script_on_stdin_says_why_its_workers_die(tmp_path, image_raw):
    """`python - < script` (or a heredoc): the forkserver's workers import __main__ again, from
    a file named <stdin>, and die; the error says so and what to do, in one line."""
    code = ("import packer\ntry:\n"
            f"    packer.build({str(image_raw)!r}, {str(tmp_path / 'out')!r}, image_size=16, workers=2)\n"
            "except packer.MmpackError as exc:\n    print(exc)\n")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "4"}  # numpy's threads: the pool's workers come from a forkserver
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, env=env, timeout=300)
    assert "<stdin> is no file; call packer.build() from a script file" in out.stdout.strip().splitlines()[-1], \
        out.stdout + out.stderr[-2000:]
