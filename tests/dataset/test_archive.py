"""Archives (`packer pack` / `unpack`, `MMapDataset(archive)`) against hostile members: a FIFO, a
member that expands past its declared size, a disk or cache too small; and `packer info` /
`verify` on an archive."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
import zstandard

from loaders import MMapDataset
from packer.cli import main
from packer.dataset import format as fmt
from packer.dataset.archive import materialize

from ..trees import tree

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def archive(tmp_path, built) -> Path:
    arc = tmp_path / "arc"
    assert main(["pack", str(built["images"]), str(arc)]) == 0
    return arc


def _member(arc: Path) -> Path:
    return next(arc.rglob("shard-*/image.npy.zst"))


def _run(code: str, *args, env=None, timeout=120) -> subprocess.CompletedProcess:
    """In a process of its own, so that a hang fails the test instead of the suite."""
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_a_fifo_member_is_refused_not_waited_on(tmp_path, archive):
    """A member that is a FIFO made `packer unpack` hang forever, and MMapDataset(archive) hang
    holding the cache lock, so that every other opener hung too."""
    member = _member(archive)
    member.unlink()
    os.mkfifo(member)
    res = _run("import sys; from packer.cli import main; sys.exit(main(['unpack', sys.argv[1], sys.argv[2]]))",
               archive, tmp_path / "out")
    assert res.returncode == 1 and "not a regular file" in res.stderr and res.stderr.count("\n") == 1, res.stderr
    opener = ("import sys\nfrom loaders import MMapDataset\nfrom packer.errors import IntegrityError\n"
              "try:\n    MMapDataset(sys.argv[1], cache_dir=sys.argv[2])\nexcept IntegrityError as exc:\n"
              "    print('refused:', exc)\n")
    for _ in range(2):  # the second opener finds the lock free
        res = _run(opener, archive, tmp_path / "cache")
        assert res.returncode == 0 and "refused:" in res.stdout and "not a regular file" in res.stdout, res.stderr


def test_a_member_that_expands_past_its_size_is_stopped_there(tmp_path, archive):
    """A member declared as a few KB that expands to 256 MB was written until the disk was full
    (its size was checked after the stream). The decompression stops at the declared size."""
    member = _member(archive)
    bomb = zstandard.ZstdCompressor(level=1).compress(b"\0" * (256 << 20))
    member.write_bytes(bomb)
    doc = json.loads((archive / fmt.ARCHIVE_NAME).read_text())
    rel = member.relative_to(archive).as_posix()
    for f in doc["files"]:
        if f["path"] == rel:  # the compressed bytes match what archive.json says of them
            f["size_bytes"], f["xxh3_128"] = len(bomb), xxhash.xxh3_128_hexdigest(bomb)
            declared = next(e["size_bytes"] for s in doc["manifest"]["shards"] for e in s["files"] if e["path"] == f["of"])
    (archive / fmt.ARCHIVE_NAME).write_text(json.dumps(doc))
    code = ("import sys\nfrom packer.cli import main\nrc = main(['unpack', sys.argv[1], sys.argv[2]])\n"
            "io = dict(line.split(': ') for line in open('/proc/self/io').read().splitlines())\n"
            "print(rc, io['wchar'])\n")
    res = _run(code, archive, tmp_path / "out")
    rc, written = res.stdout.split()
    assert rc == "1" and "holds more than the" in res.stderr and member.name in res.stderr, res.stderr
    assert int(written) < declared * 4 + (16 << 20), (written, declared)  # not 256 MB
    assert not (tmp_path / "out" / fmt.MANIFEST_NAME).exists()


def test_too_little_room_is_said_before_anything_is_written(tmp_path, archive, monkeypatch, capsys):
    import shutil

    from loaders import MMapDataset
    from packer.dataset import archive as arch
    from packer.errors import ConfigError

    real = shutil.disk_usage
    monkeypatch.setattr(arch.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    assert main(["unpack", str(archive), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "the dataset needs" in err and "MiB free" in err and str(tmp_path / "out") in err and err.count("\n") == 1
    monkeypatch.delenv("MMPACK_CACHE", raising=False)
    monkeypatch.setenv("MMPACK_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"no room to unpack .*point \$MMPACK_CACHE at a disk with room"):
        MMapDataset(archive)


def test_a_full_cache_is_one_line_naming_mmpack_cache(tmp_path, archive):
    """A real full disk under the cache: a 1 MB tmpfs in a private mount namespace."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    code = ("import sys\nfrom loaders import MMapDataset\nfrom packer.errors import MmpackError\n"
            "try:\n    MMapDataset(sys.argv[1])\nexcept MmpackError as exc:\n    print('refused:', exc)\n")
    shell = 'mount -t tmpfs -o size=1m mmpack-cache "$1" && shift && exec "$@"'
    try:
        res = subprocess.run(["unshare", "-rm", "sh", "-c", shell, "sh", str(mnt), sys.executable, "-c", code,
                              str(archive)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                             env={**os.environ, "MMPACK_CACHE": str(mnt)})
    except FileNotFoundError:
        pytest.skip("needs unshare")
    if "mount" in res.stderr and res.returncode != 0:
        pytest.skip("needs user namespaces to mount a small tmpfs")
    assert res.returncode == 0 and "refused:" in res.stdout and "$MMPACK_CACHE" in res.stdout, res.stdout + res.stderr


def test_info_and_verify_take_an_archive(tmp_path, archive, built, capsys):
    """packer info and verify refused archives that MMapDataset opens."""
    assert main(["info", str(archive)]) == 0
    out = capsys.readouterr().out
    assert "zstd archive" in out and "compressed" in out and "found" in out
    assert " KiB" in out or " MiB" in out  # sizes in binary units say so (they printed "MB" for MiB)
    assert main(["info", str(archive), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_samples"] > 0 and info["archive_bytes"] > 0
    assert main(["verify", str(archive)]) == 0
    assert "ok:" in capsys.readouterr().out
    member = _member(archive)
    raw = bytearray(member.read_bytes())
    raw[len(raw) // 2] ^= 1
    member.write_bytes(bytes(raw))
    assert main(["verify", str(archive)]) == 1
    assert member.name in capsys.readouterr().err


def test_info_into_a_closed_pipe_is_quiet(built):
    """`packer info OUT | head -1` printed 'error: Broken pipe' once head had its line."""
    code = ("import os, sys\nfrom packer.cli import main\nr, w = os.pipe()\nos.close(r)\n"
            "os.dup2(w, sys.stdout.fileno())\nsys.exit(main(['info', sys.argv[1], '--skipped']))\n")
    res = _run(code, built["images"])
    assert res.returncode == 141 and res.stderr == "", res.stderr
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
