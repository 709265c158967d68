"""A/B of `Loader`'s default between two source trees (say a commit before a change and after),
alternated in one run, each round in fresh processes: the check that a change left the gather
within noise. Rates from separate runs of a shared machine do not compare; alternated ones do.

    git worktree add /tmp/before <commit>   # then build its C copies: pip wheel --no-deps, or cc
    python -m bench.ab_loader /tmp/before . DATASET_DIR [--rounds 10] [--batch-size 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import json, sys, time
from loaders import Loader, MMapDataset
import loaders
try:
    from loaders.batch import native
except ImportError:  # a tree from before loaders/batch/
    from loaders import native
ds = MMapDataset(sys.argv[1], columns=["image", "label"])
loader, best = Loader(ds, int(sys.argv[2])), 0.0
for _ in range(4):
    start = time.perf_counter()
    n = sum(len(b["label"]) for b in loader)
    best = max(best, n / (time.perf_counter() - start))
print(json.dumps({"where": loaders.__file__, "rate": best, "native": native.LIB is not None}))
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("dataset", type=Path)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=256)
    args = ap.parse_args(argv)
    rates: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for name in rates:
            tree = getattr(args, name).resolve()
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.dataset), str(args.batch_size)],
                                 capture_output=True, text=True, cwd="/", env={**os.environ, "PYTHONPATH": str(tree)})
            if out.returncode:
                raise SystemExit(f"{tree}: {out.stderr.strip().splitlines()[-1]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            if not row["where"].startswith(str(tree)) or not row["native"]:
                raise SystemExit(f"{tree}: loaded {row['where']} (native copies: {row['native']}); build its C copies")
            rates[name].append(round(row["rate"]))
    for name, values in rates.items():
        print(f"{name}: median {sorted(values)[len(values) // 2]:,} images/s (range {min(values):,}-{max(values):,}): "
              + " ".join(f"{v:,}" for v in values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
