"""`packer.map` from the user's side: its output is the same bytes at 1, 2 and 4 workers, in
input order; skips carry their reasons (found = packed + skipped); killed at any point and run
again, it goes on from the tasks it finished and ends with the uninterrupted run's bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import packer
from loaders import MMapDataset

TOOL = Path(__file__).parents[1] / "tools" / "map_features.py"
ITEMS = 200


def _run(out: Path, workers: int, env: dict | None = None) -> int:
    return subprocess.run([sys.executable, str(TOOL), str(out), str(workers), str(ITEMS)],
                          env={**os.environ, **(env or {})}, capture_output=True).returncode


def _doc(out: Path) -> dict:
    doc = json.loads((out / "manifest.json").read_text())
    doc["build"] = {k: v for k, v in doc["build"].items() if k not in ("seconds",)}
    return doc


@pytest.fixture(scope="module")
def mapped(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("map")
    outs = {w: root / f"w{w}" for w in (1, 2, 4)}
    for w, out in outs.items():
        assert _run(out, w) == 0
    return outs


def test_the_same_bytes_at_any_worker_count_in_input_order(mapped):
    docs = [_doc(out) for out in mapped.values()]
    assert docs[0] == docs[1] == docs[2]
    ds = MMapDataset(mapped[1])
    sys.path.insert(0, str(TOOL.parent))
    from map_features import features

    want = []
    for i in range(ITEMS):
        try:
            got = features(i)
        except ValueError:
            continue
        for j, s in enumerate([got] if isinstance(got, dict) else got or []):
            want.append((s.get("key", f"{i}" if isinstance(got, dict) else f"{i}:{j}"), s))
    assert [ds[k]["key"] for k in range(len(ds))] == [k for k, _ in want]
    for k, (_, s) in enumerate(want):
        assert np.array_equal(ds[k]["feat"].numpy(), s["feat"]) and ds[k]["speaker"] == s["speaker"]
    m = ds.manifest
    reasons = {s.key: s.reason for s in m.skipped}
    assert reasons["4"] == "fn returned None" and reasons["6"] == "ValueError: item 6 is damaged"
    assert m.counts["found"] == m.counts["packed"] + m.counts["skipped"] and m.counts["packed"] == len(want)
    assert len(m.shards) > 13  # tasks of 16 items, several shards some of them


@pytest.mark.parametrize("workers, kill_at", [(1, 37), (2, 150)])
def test_killed_and_run_again_it_ends_with_the_uninterrupted_bytes(mapped, tmp_path, workers, kill_at):
    out = tmp_path / "out"
    env = {"MMPACK_TEST_KILL_AT": str(kill_at)}
    assert _run(out, workers, env) == -9
    finished = sorted(p.name for p in (out / ".staging").glob("task-*.json"))
    assert finished and not (out / "manifest.json").exists()
    with pytest.raises(packer.MmpackError):  # nothing that opens
        MMapDataset(out)
    assert _run(out, workers) == 0
    assert _doc(out) == _doc(mapped[1])


def test_an_unpicklable_function_with_workers_is_one_line_and_a_lambda_runs_in_one(tmp_path):
    with pytest.raises(packer.ConfigError, match="module-level function"):
        packer.map(lambda i: {"x": np.arange(i)}, list(range(200)), tmp_path / "a", workers=2, chunk=8)
    m = packer.map(lambda i: {"x": np.arange(i)}, list(range(20)), tmp_path / "b", workers=1)
    assert m.counts["packed"] == 20


def test_a_sample_whose_columns_differ_from_the_first_ends_the_map_in_one_line(tmp_path):
    """fn's own shape changing (a column more or less than the first sample's) is not an item's
    damage: every later sample would be skipped for it, so the map stops, naming the sample."""
    import numpy as np

    from packer.errors import ConfigError

    def fn(i):
        sample = {"feat": np.full((i % 3 + 1, 4), i, np.float16)}
        return sample if i < 5 else {**sample, "n": i}
    with pytest.raises(ConfigError, match=r"sample '5' has n too; the columns are feat") as got:
        packer.map(fn, list(range(20)), tmp_path / "out", workers=1)
    assert "\n" not in str(got.value) and not (tmp_path / "out" / "manifest.json").exists()
