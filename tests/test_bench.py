"""`bench loaders` in its smallest size: every system has a row with sane positive figures and
missing peers are reported, not fatal. Not a speed test."""

from __future__ import annotations

import json

from bench.cli import main


def test_bench_loaders_smallest(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["loaders", "--images", "48", "--text-mb", "0.3", "--batch-size", "16", "--passes", "1",
                 "--work", str(tmp_path / "w"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    systems = [r["system"] for r in report["results"]]
    assert any(s.startswith("mmpack Loader") for s in systems)
    assert any(s.startswith("on-the-fly") for s in systems) and any(s.startswith("MMapDataset") for s in systems)
    assert any("TokenWindows" in s for s in systems)
    for r in report["results"]:
        assert r.get("samples_per_s", r.get("tokens_per_s")) > 0 and r["pct_memcpy"] > 0
    assert report["memcpy_bytes_per_s"] > 0 and report["machine"]["cores"] >= 1
    assert set(report["peers"]) == {"webdataset", "litdata", "streaming", "datasets"}
    table = capsys.readouterr().out
    assert "% memcpy" in table and "peer webdataset" in table
