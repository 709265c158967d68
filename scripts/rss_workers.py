"""Memory of many DataLoader workers over one packed dataset: RSS and PSS per process.

Builds (once) a text dataset of N short documents, then iterates it with DataLoader workers and
reads /proc/PID/smaps_rollup of the main process and every worker at the start and the end.
PSS counts shared page-cache pages once across processes: if each worker copied the index, PSS
would grow with the worker count; with maps it stays flat.

    python scripts/rss_workers.py [--docs 1000000] [--workers 8] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from bench import data
from bench.measure import rollup, tree_pids
from loaders import MMapDataset
import packer


def tree() -> list[dict]:
    """RSS and PSS of this process and each of its children (DataLoader workers)."""
    return [{"pid": pid, **rollup(pid)} for pid in tree_pids()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mmpack-rss"))
    args = ap.parse_args()
    out = args.work / "out"
    if not (out / "manifest.json").exists():
        raw = args.work / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        lines = data.caption_lines(5000)
        rng = random.Random(0)
        with open(raw / "docs.jsonl", "w") as f:
            for _ in range(args.docs):
                f.write(json.dumps({"text": rng.choice(lines)}) + "\n")
        packer.build(raw, out, tokenizer=data.minilm_tokenizer(), overwrite=True)
    ds = MMapDataset(out, columns=["tokens"])
    loader = torch.utils.data.DataLoader(ds, batch_size=512, shuffle=True, num_workers=args.workers,
                                         collate_fn=lambda b: len(b), persistent_workers=True)
    it = iter(loader)
    seen = sum(next(it) for _ in range(args.workers * 2))
    start = tree()
    for n in it:
        seen += n
    end = tree()
    report = {"docs": len(ds), "workers": args.workers, "samples_read": seen, "start": start, "end": end,
              "pss_total_mb_start": sum(p["pss_mb"] for p in start), "pss_total_mb_end": sum(p["pss_mb"] for p in end)}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
