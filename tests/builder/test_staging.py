"""A build's staging: a killed build resumed, other arguments refused, parts then commit,
--overwrite waiting for a killed build's writer."""

from __future__ import annotations

import json
import shutil

import pytest

from loaders import MMapDataset
from packer.dataset import format as fmt
from packer.cli import main
from packer.errors import ManifestError

from ..procs import kill_mid_build


from ..trees import IMG, build, tree


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


def test_overwrite_waits_for_a_killed_builds_last_writer(tmp_path, image_raw):
    """--overwrite deletes an unfinished build of other arguments, but not under a worker of the
    killed build that is still finishing its shard: it waits for that shard's lock first."""
    import threading

    from packer.builder import run as builder, shard as shards, staging

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
        assert (old.ctx.staging / staging.RECORD_FILE).exists()  # the old build's staging is still there
    runner.join(timeout=60)
    assert rc == {"rc": 0} and MMapDataset(out)[0]["image"].shape == (16, 16, 3)
