"""Builds and datasets that cannot be corrupted: one writer per OUT, a publish that a kill at any
instant cannot break, no orphan worker, readers that never see another build's bytes, any
decoder failure a skip, and a build that skips too much refused. Real subprocesses, real files."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bench import data
from loaders import MMapDataset
from packer.dataset import format as fmt
from packer.dataset import outdir
from packer.cli import main
from packer.errors import ManifestError
from packer.dataset.reader import load_manifest

from .trees import tree

ROOT = Path(__file__).resolve().parent.parent


def packer(*args, script: str | None = None, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """`packer ARGS` in a new process (through `script`, a file run as __main__, when given)."""
    cmd = [sys.executable, script] if script else [sys.executable, "-m", "packer"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=300, **kw)


def one_line(result: subprocess.CompletedProcess, *, rc: int = 2) -> str:
    assert result.returncode == rc, (result.returncode, result.stderr[-2000:])
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr


@pytest.fixture(scope="module")
def small_raw(tmp_path_factory) -> Path:
    """A dozen real photo crops in class folders: builds of a second or less."""
    return data.make_image_folders(tmp_path_factory.mktemp("small") / "raw", 12, seed=3, max_side=120)


# -- one writer per OUT ------------------------------------------------------------------------
def test_a_second_writer_is_refused_at_once_naming_the_holder(tmp_path, small_raw):
    out = tmp_path / "out"
    assert main(["build", str(small_raw), str(out), "--image-size", "16", "-q"]) == 0
    shutil.copytree(out, tmp_path / "copy")
    commands = [("build", small_raw, out, "--image-size", "16", "--overwrite"),
                ("build", small_raw, out, "--image-size", "16", "--append"),
                ("build", small_raw, out, "--image-size", "16", "--part", "0/2"), ("commit", out),
                ("merge", out, tmp_path / "copy", out, "--overwrite", "--allow-duplicate-keys"),
                ("unpack", tmp_path / "arc", out, "--overwrite")]
    assert main(["pack", str(out), str(tmp_path / "arc")]) == 0
    with outdir.locked(out):  # held through every command: one that waited for it would never end
        for command in commands:
            err = one_line(packer(*command))
            assert f"another mmpack process is writing it (pid {os.getpid()}" in err, command
    assert main(["verify", str(out)]) == 0


def test_two_builds_started_together_publish_one_whole_dataset(tmp_path, image_raw):
    args = ["--image-size", "48", "--shard-size", "8", "--workers", "2", "-q"]
    assert main(["build", str(image_raw), str(tmp_path / "clean"), *args]) == 0
    for attempt in range(3):
        out = tmp_path / f"out{attempt}"
        cmd = [sys.executable, "-m", "packer", "build", str(image_raw), str(out), *args]
        procs = [subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
        # the one that comes second is refused while the first writes, or, on a machine fast enough
        # that the first has published before it looks, finds that dataset up to date
        assert sorted(rc for rc, _ in results) in ([0, 0], [0, 2]), results
        for err in (e for rc, e in results if rc == 2):
            assert err.count("\n") == 1 and ("another mmpack process is writing it" in err or "already exists" in err)
        assert main(["verify", str(out)]) == 0 and tree(out) == tree(tmp_path / "clean")


LOCK_AND_DIE = """
import os, sys, time
from pathlib import Path
from packer.dataset import outdir
with outdir.locked(Path(sys.argv[1])):
    if os.fork() == 0:  # a worker that inherited the lock's file, and outlives its writer a moment
        time.sleep(float(sys.argv[2]))
        Path(sys.argv[3]).touch()  # its last act
        os._exit(0)
    print("locked", flush=True)
    time.sleep(60)
"""


def test_the_lock_of_a_dead_writer_is_taken_over_once_its_last_worker_is_gone(tmp_path, small_raw):
    out, gone = tmp_path / "out", tmp_path / "worker-gone"
    holder = subprocess.Popen([sys.executable, "-c", LOCK_AND_DIE, str(out), "2", str(gone)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    holder.kill()
    holder.wait()
    assert main(["build", str(small_raw), str(out), "--image-size", "16", "-q"]) == 0  # waits for the worker
    wrote = [p.stat().st_ctime_ns for p in out.rglob("*") if p.is_file() and p.name != fmt.LOCK_NAME]
    assert gone.exists() and min(wrote) >= gone.stat().st_mtime_ns  # every file of the build came after it
    assert main(["verify", str(out)]) == 0


# -- publish that can be resumed -----------------------------------------------------------------
KILL_IN_PUBLISH = """
import os, signal, sys
import packer.cli
from packer.dataset import outdir

KILL_AT = int(os.environ["KILL_AT"])
WRITES = ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.replace", "os.truncate")
publish, seen = outdir.publish, [0]


def writes(event, args):
    if event == "open":
        mode, flags = args[1], args[2]
        return (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR))
    return event in WRITES


def hook(event, args):
    if publishing and writes(event, args):
        seen[0] += 1
        if seen[0] == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


def killed_publish(out, manifest):
    global publishing
    publishing = True
    return publish(out, manifest)


publishing = False
sys.addaudithook(hook)
outdir.publish = killed_publish
if __name__ == "__main__":
    sys.exit(packer.cli.main(sys.argv[1:]))
"""


def _only_the_dataset(out: Path) -> None:
    """No staging, no temp file, no generation but the manifest's: a finished command's OUT."""
    names = {p.name for p in out.iterdir()}
    assert names == {fmt.MANIFEST_NAME, fmt.LOCK_NAME, load_manifest(out).generation}, names
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp") or p.name.endswith(".partial")]


@pytest.mark.parametrize("scenario", ["fresh", "overwrite"])
def test_a_kill_at_any_write_of_the_publish_then_the_same_command_gives_a_clean_builds_bytes(
        tmp_path, small_raw, scenario):
    """SIGKILL at the k-th write (open for writing, rename, remove, mkdir, rmtree) of publish,
    for every k: OUT opens as the old dataset or the new one (or says the build is incomplete),
    and the same command, run again, finishes with the bytes of a clean build and no leftovers."""
    script = tmp_path / "kill_in_publish.py"
    script.write_text(KILL_IN_PUBLISH)
    sizes = {16: tmp_path / "clean16", 24: tmp_path / "clean24"}
    for size, clean in sizes.items():
        assert main(["build", str(small_raw), str(clean), "--image-size", str(size), "-q"]) == 0
    out, size, k = tmp_path / "out", 24, 0
    if scenario == "overwrite":
        assert main(["build", str(small_raw), str(out), "--image-size", "16", "-q"]) == 0
    while True:
        k += 1
        args = ["build", small_raw, out, "--image-size", size, "-q", "--workers", "1"]
        args += ["--overwrite"] if scenario == "overwrite" else []
        killed = packer(*args, script=str(script), env={"KILL_AT": str(k)})
        if killed.returncode == 0:
            break  # k is past the last write: every instant was tried
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        try:
            shape = MMapDataset(out).manifest.column("image").shape
            assert shape in ((16, 16, 3), (24, 24, 3)) and main(["verify", str(out)]) == 0  # old or new
        except ManifestError as exc:
            assert scenario == "fresh" and "incomplete build" in str(exc)
        assert main([str(a) for a in args]) == 0, k  # the same command again (the CLI's own main): done
        assert tree(out) == tree(sizes[size]) and main(["verify", str(out)]) == 0
        _only_the_dataset(out)
        if scenario == "fresh":
            shutil.rmtree(out)
        else:
            size = 16 if size == 24 else 24  # the next kill overwrites this one
    assert k > 8  # the publish was interrupted at every one of its writes
    _only_the_dataset(out)


# -- no orphan ever writes -----------------------------------------------------------------------
def _session(pid: int) -> list[tuple[int, str]]:
    """Processes of the session `pid` leads that still run (zombies are done), with their state."""
    alive = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getsid(int(d.name)) == pid:
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    alive.append((int(d.name), state))
        except (OSError, ProcessLookupError):
            continue
    return alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds and /proc are Linux's")
@pytest.mark.parametrize("kind", ["text", "images"])
@pytest.mark.timing
def test_killing_the_build_stops_every_worker_within_a_second(tmp_path, text_raw, image_raw, minilm, kind):
    """SIGKILL to the build process alone (a forkserver's workers for text, forked ones for
    images): every process it started is gone in under half the time the build had run (a worker
    that outlived it would go on with its shard), and nothing in OUT changes after."""
    out = tmp_path / "out"
    extra = (["--tokenizer", minilm, "--shard-size", "64KB"] if kind == "text"
             else ["--image-size", "96", "--shard-size", "4"])
    cmd = [sys.executable, "-m", "packer", "build", str(text_raw if kind == "text" else image_raw), str(out),
           "-q", "--workers", "2", *map(str, extra)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staging = out / fmt.STAGING_DIR
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if staging.is_dir() and any(p.name.endswith(".json") and p.name.startswith("shard-") for p in staging.iterdir()):
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the build ended before it could be killed"
    assert len(_session(proc.pid)) >= 3  # the build and its workers (and for text, the forkserver)
    ran, killed = time.monotonic() - started, time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    while _session(proc.pid) and time.monotonic() - killed < 60:
        time.sleep(0.01)
    gone = time.monotonic() - killed
    try:
        assert _session(proc.pid) == [] and gone < ran / 2, (gone, ran)
        before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
        time.sleep(1.0)
        assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before
    finally:
        for pid, _ in _session(proc.pid):
            os.kill(pid, signal.SIGKILL)


# -- readers never see bytes of another build ----------------------------------------------------
READER = """
import hashlib, json, sys
from loaders import MMapDataset
ds = MMapDataset(sys.argv[1])
print("open", flush=True)
sys.stdin.readline()  # meanwhile the dataset is rebuilt
try:
    print(json.dumps([hashlib.sha256(ds[i]["image"].numpy().tobytes()).hexdigest() for i in range(len(ds))]))
except Exception as exc:
    print(json.dumps(f"{type(exc).__module__}.{type(exc).__name__}: {exc}"))
"""


def _image_digests(out: Path) -> list[str]:
    import hashlib

    ds = MMapDataset(out)
    return [hashlib.sha256(ds[i]["image"].numpy().tobytes()).hexdigest() for i in range(len(ds))]


def test_an_overwrite_under_a_live_reader_never_hands_it_the_new_bytes(tmp_path, image_raw):
    """A reader in another process opens the dataset, touches no shard, and reads everything only
    after an --overwrite of the same shape but other pixels: it reads the build it opened."""
    raw2 = tmp_path / "raw2"
    shutil.copytree(image_raw, raw2, symlinks=True)
    from PIL import Image

    for path in raw2.glob("[!h]*/*.png"):  # other pixels, same names and sizes (not the hostile files)
        with Image.open(path) as img:
            img.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(path)
    out = tmp_path / "out"
    args = ["--image-size", "32", "--shard-size", "8", "-q"]
    assert main(["build", str(image_raw), str(out), *args]) == 0
    old = _image_digests(out)
    reader = subprocess.Popen([sys.executable, "-c", READER, str(out)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "open"
    assert main(["build", str(raw2), str(out), *args, "--overwrite"]) == 0
    new = _image_digests(out)
    assert new != old and len(new) == len(old)
    got, _ = reader.communicate("go\n", timeout=120)
    assert json.loads(got) == old
    assert main(["build", str(image_raw), str(out), *args, "--overwrite"]) == 0  # the reader is gone: so is its build
    assert len([p for p in out.iterdir() if fmt.is_generation(p.name)]) == 1


# -- hostile manifests ---------------------------------------------------------------------------
def _edit(out: Path, change) -> None:
    path = out / fmt.MANIFEST_NAME
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _set_file_path(doc, path: str) -> None:
    doc["shards"][0]["files"][0]["path"] = path


def _rename_column(doc, name: str) -> None:
    doc["columns"][0]["name"] = name


@pytest.mark.parametrize("change", [
    lambda d: _rename_column(d, "../../outside/secret"),
    lambda d: _rename_column(d, "/etc/passwd"),
    lambda d: _rename_column(d, "a\0b"),
    lambda d: _set_file_path(d, "../../../../etc/passwd"),
    lambda d: _set_file_path(d, "/etc/passwd"),
    lambda d: _set_file_path(d, d["generation"] + "/shard-00000/../../../secret.npy"),
    lambda d: d.update(generation="../elsewhere"),
    lambda d: d["columns"][0].update(dtype="|O"),
    lambda d: d["columns"][0].update(encoding="rot13"),
    lambda d: d["shards"][0]["files"][0].update(size_bytes=None),
    lambda d: d["shards"][0].update(num_samples=10**12),
    lambda d: d.update(counts={"found": "3", "packed": 1, "skipped": 2}),
], ids=["dotdot-column", "absolute-column", "nul-column", "dotdot-file", "absolute-file", "file-climbing-out",
        "generation-climbing-out", "object-dtype", "unknown-encoding", "null-size", "huge-rows", "string-count"])
def test_a_hostile_manifest_is_refused_before_anything_outside_is_touched(tmp_path, built, change, capsys):
    out = tmp_path / "ds"
    shutil.copytree(built["images"], out)
    secret = tmp_path / "secret.npy"
    secret.write_bytes(b"\x93NUMPY" + b"x" * 200)
    _edit(out, change)
    with pytest.raises(ManifestError):
        MMapDataset(out)
    for command in ("verify", "info"):
        assert main([command, str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(out / fmt.MANIFEST_NAME) in err


# -- crash isolation -----------------------------------------------------------------------------
CRASHING_DECODER = """
import os, sys
import packer.cli
from packer.builder import pool as engines, images, shard as shards

decode = images.decode_image


def crashing(path, *args, **kwargs):
    if os.path.basename(str(path)).startswith("crash-me"):
        os.abort()  # a decoder that kills its process (a segfault alike)
    return decode(path, *args, **kwargs)


images.decode_image = shards.decode_image = engines.decode_image = crashing
if __name__ == "__main__":
    sys.exit(packer.cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("workers,sizing", [(1, "crop"), (2, "crop"), (1, "keep-aspect"), (2, "keep-aspect")])
def test_any_decoder_failure_is_a_skip_and_a_dying_worker_costs_one_record(tmp_path, workers, sizing):
    """Pillow's NotImplementedError (three real DDS files named .png) is a skip with its type; a
    decoder that aborts its process costs that record alone, the build goes on: for fixed-size
    images (shards in pieces) and keep-aspect ones (whole shards per worker) alike."""
    size = ["--image-size", "32", *(["--keep-aspect"] if sizing == "keep-aspect" else [])]
    raw = tmp_path / "raw"
    data.make_image_folders(raw, 30, seed=5, max_side=100)
    extra = data.fetch(data.PILLOW_EXTRA)
    dds = sorted(extra.glob("*.dds"))
    for path in dds:
        shutil.copy(path, raw / "astronaut" / (path.stem + ".png"))
    shutil.copy(next(raw.glob("*/*.png")), raw / "coffee" / "crash-me.png")
    script = tmp_path / "crashing.py"
    script.write_text(CRASHING_DECODER)
    out = tmp_path / "out"
    result = packer("build", raw, out, *size, "--shard-size", "8", "--workers", workers, "-q", script=str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    m = load_manifest(out)
    skips = {s.key: s.reason for s in m.skipped}
    assert set(skips) == {"coffee/crash-me.png", *(f"astronaut/{p.stem}.png" for p in dds)}
    assert "crashed" in skips["coffee/crash-me.png"]
    assert all("NotImplementedError" in skips[f"astronaut/{p.stem}.png"] for p in dds)
    assert m.counts == {"found": 34, "packed": 30, "skipped": 4} and main(["verify", str(out)]) == 0
    clean = tmp_path / "clean"
    for path in [*raw.glob("astronaut/unimplemented*"), raw / "coffee" / "crash-me.png"]:
        path.unlink()
    assert main(["build", str(raw), str(clean), *size, "--shard-size", "8", "-q"]) == 0
    ds, ref = MMapDataset(out), MMapDataset(clean)
    assert [ds[i]["key"] for i in range(len(ds))] == [ref[i]["key"] for i in range(len(ref))]
    assert all(np.array_equal(ds[i]["image"], ref[i]["image"]) for i in range(len(ds)))


@pytest.mark.parametrize("sizing", ["crop", "keep-aspect"])
def test_several_crashing_files_cost_themselves_not_the_pieces_beside_them(tmp_path, sizing):
    """Three files that each kill their decoder's process, in one piece (or shard), while the
    other worker decodes an innocent one: each death is traced to its file, and the innocent
    work, run again each time, is never taken for the culprit (nor the build failed for it)."""
    raw = tmp_path / "raw"
    for i, src in enumerate(sorted(data.make_image_folders(tmp_path / "src", 48, seed=9, max_side=90).rglob("*.*"))):
        name = f"img-{i:03d}{'-crash-me' if i in (6, 10, 14) else ''}{src.suffix}"
        (raw / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, raw / name)
    script = tmp_path / "crashing.py"
    script.write_text(CRASHING_DECODER.replace('.startswith("crash-me")', '.split(".")[0].endswith("crash-me")')
                      .replace("import packer.cli", "import packer.cli, packer.builder.pieces\npacker.builder.pieces.PIECE_ROWS = 24"))
    size = ["--image-size", "32", *(["--keep-aspect"] if sizing == "keep-aspect" else [])]
    out = tmp_path / "out"
    result = packer("build", raw, out, *size, "--shard-size", "48" if sizing == "crop" else "16", "--workers", 2,
                    "-q", script=str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    m = load_manifest(out)
    assert sorted(s.key for s in m.skipped) == sorted(p.name for p in raw.iterdir() if "crash-me" in p.name)
    assert all("crashed" in s.reason for s in m.skipped) and m.counts == {"found": 48, "packed": 45, "skipped": 3}


CRASHING_TOKENIZER = """
import os, sys
import packer.cli
from packer.builder import text

encode = text.encode_batch


def crashing(tok, texts, **kwargs):
    if any("CRASH-ME" in t for t in texts) and len(texts) >= int(os.environ.get("CRASH_FROM_DOCS", "1")):
        os.abort()  # a tokenizer that kills its process (a segfault, the kernel's OOM killer alike)
    return encode(tok, texts, **kwargs)


text.encode_batch = crashing
if __name__ == "__main__":
    sys.exit(packer.cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("workers,shard_size", [(1, "1MB"), (2, "8KB")])  # one shard in one worker; several in two
def test_a_document_that_kills_the_tokenizers_process_costs_that_document(tmp_path, minilm, workers, shard_size):
    """A worker that dies tokenizing costs the one document it died on, found among the
    documents it was on by halving them in processes of their own; every other document is
    packed as a build without the crash packs it."""
    raw = tmp_path / "raw"
    raw.mkdir()
    lines = [{"text": f"document {i} of a corpus, with words " * (1 + i % 7)} for i in range(400)]
    lines[233] = {"text": "this one has CRASH-ME inside"}
    (raw / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    script = tmp_path / "crashing.py"
    script.write_text(CRASHING_TOKENIZER)
    out, ref = tmp_path / "out", tmp_path / "ref"
    args = ["--tokenizer", str(minilm), "--shard-size", shard_size, "-q"]
    result = packer("build", raw, out, *args, "--workers", workers, script=str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    m = load_manifest(out)
    assert [(s.key, s.stage) for s in m.skipped] == [("docs.jsonl:234", "tokenize")]
    assert "crashed" in m.skipped[0].reason
    assert m.counts == {"found": 400, "packed": 399, "skipped": 1} and (len(m.shards) > 3) == (workers == 2)
    assert not list(out.rglob("*.busy"))
    assert main(["build", str(raw), str(ref), *args]) == 0
    ds, full = MMapDataset(out), MMapDataset(ref)
    tokens = {full[i]["key"]: full[i]["tokens"] for i in range(len(full))}
    assert [ds[i]["key"] for i in range(len(ds))] == [k for k in tokens if k != "docs.jsonl:234"]
    assert all(np.array_equal(ds[i]["tokens"], tokens[ds[i]["key"]]) for i in range(len(ds)))
    # a process that dies only on a batch (no one document kills it alone): RETRIES runs, then one line
    again = packer("build", raw, tmp_path / "again", *args, "--workers", workers, script=str(script),
                   env={"CRASH_FROM_DOCS": "2"})
    err = one_line(again)
    assert "died 3 times" in err and "no one item kills" in err and str(raw) in err, err
    assert re.search(r"shard-\d+ items \d+\.\.\d+", err), err
    assert not (tmp_path / "again" / fmt.MANIFEST_NAME).exists()


def test_a_document_the_tokenizer_refuses_is_a_skip(tmp_path, minilm):
    raw = tmp_path / "raw"
    raw.mkdir()
    lines = [{"text": "plain words"}, {"text": "a lone surrogate \ud800 here"}, {"text": "more words"}]
    (raw / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), "--tokenizer", str(minilm), "-q"]) == 0
    m = load_manifest(out)
    assert [(s.key, s.stage) for s in m.skipped] == [("docs.jsonl:2", "tokenize")]
    assert "TypeError" in m.skipped[0].reason and m.counts["packed"] == 2


def test_a_build_that_skips_more_than_max_skipped_publishes_nothing(tmp_path, small_raw, capsys):
    raw = tmp_path / "raw"
    shutil.copytree(small_raw, raw)
    for i in range(6):
        (raw / "astronaut" / f"broken-{i}.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), "--image-size", "16", "-q", "--max-skipped", "0.2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "6 of 18 records skipped" in err and "--max-skipped 0.2" in err
    assert not (out / fmt.MANIFEST_NAME).exists()
    assert main(["build", str(raw), str(out), "--image-size", "16", "-q", "--max-skipped", "0.5"]) == 0


# -- --append tells the truth ----------------------------------------------------------------------
def test_append_refuses_deleted_or_changed_files_and_reports_what_is_new(tmp_path, small_raw, capsys):
    raw = tmp_path / "raw"
    shutil.copytree(small_raw, raw)
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), "--image-size", "16", "-q"]) == 0
    before = len(MMapDataset(out))
    files = sorted(raw.glob("*/*.*"))
    files[0].unlink()
    files[1].write_bytes(files[2].read_bytes())  # rewritten
    shutil.copy(files[3], raw / files[3].parent.name / "new-1.png")
    shutil.copy(files[4], raw / files[4].parent.name / "new-2.png")
    args = ["build", str(raw), str(out), "--image-size", "16", "--append"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1 file(s)" in err and "deleted and 1 changed" in err
    assert f"{files[0].relative_to(raw).as_posix()} (deleted)" in err and "--allow-changed" in err
    assert len(MMapDataset(out)) == before  # nothing appended
    assert main([*args, "--allow-changed"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("appended 2 new records = packed 2 + skipped 0 in ") and f"{before + 2}" in line
    m = load_manifest(out)
    assert m.counts == {"found": before + 2, "packed": before + 2, "skipped": 0} and main(["verify", str(out)]) == 0
    assert main(args) == 2  # the dataset still holds the old samples of those files: said again
    assert main([*args, "--allow-changed"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("appended 0 new records")
    assert len(MMapDataset(out)) == before + 2 and main(["verify", str(out)]) == 0


def test_a_pickled_reader_reopens_the_build_it_was_opened_on(tmp_path, text_raw, minilm):
    """What a DataLoader worker gets: a dataset, token view or packed view pickled before an
    --overwrite and unpickled after it reads the build the main process opened."""
    import pickle

    from loaders import PackedDocuments, TokenWindows

    out = tmp_path / "out"
    args = ["--tokenizer", str(minilm), "-q", "--shard-size", "64KB"]
    assert main(["build", str(text_raw), str(out), *args]) == 0
    views = [MMapDataset(out), TokenWindows(out, 64), PackedDocuments(out, 128)]
    pickled = [pickle.dumps(v) for v in views]
    before = [views[0][3]["tokens"].tolist(), views[1][5][0].tolist(), views[2].packing.row_tokens().tolist()]
    assert main(["build", str(text_raw), str(out), *args, "--append-eos", "--overwrite"]) == 0  # other tokens
    assert MMapDataset(out)[3]["tokens"].tolist() != before[0]
    again = [pickle.loads(p) for p in pickled]
    assert [again[0][3]["tokens"].tolist(), again[1][5][0].tolist(), again[2].packing.row_tokens().tolist()] == before


def test_dropped_readers_let_rebuilds_remove_old_generations_without_the_gc(tmp_path, small_raw):
    """Readers made and dropped between --overwrite rebuilds, the garbage collector off: every
    dropped reader lets go of its generation at once, so OUT keeps at most 3 (a Loader's
    reference cycle held its dataset's reader lock until the cyclic GC ran: 8 readers and 24
    overwrites left 21 old generations)."""
    import gc

    from loaders import Loader, MMapDataset

    out = tmp_path / "out"
    gc.collect()
    gc.disable()
    try:
        for n in range(8):
            assert main(["build", str(small_raw), str(out), "-q", "--image-size", "16", "--shard-size", str(2 + n % 3),
                         "--overwrite"]) == 0
            ds = MMapDataset(out)
            loader = Loader(ds, 4, num_threads=2, num_buffers=2)
            it = iter(loader)
            next(it)  # a pass left open, as a peek leaves it
            batched = ds.batched(4)
            next(iter(batched))
            del ds, loader, it, batched
        generations = [p.name for p in out.iterdir() if fmt.is_generation(p.name)]
        assert len(generations) <= 3, generations
    finally:
        gc.enable()
