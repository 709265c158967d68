"""A Mixture of 3 datasets against one dataset of the same total (issue 35's "at least 95%"),
alternated in one process: the crops of `bench loaders` built whole and cut in three datasets
with every class folder in each (so their labels mean the same classes), `Loader(ds, 256)` with
default threads, the best of 4 passes of each per round.

    python -m bench.ab_mixture --work /tmp/brw [--images 3000] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from .measure import alternated


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.ab_mixture", description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="raw and built data, made once and reused")
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=256)
    args = ap.parse_args(argv)
    from loaders import Mixture, MMapDataset

    from .prepare import prepare_image_thirds, prepare_images

    from loaders import Loader

    one = MMapDataset(prepare_images(args.work, args.images)[1])
    parts = [MMapDataset(p) for p in prepare_image_thirds(args.work, args.images)]
    mixture = Mixture(parts, [len(p) for p in parts], num_samples=len(one))
    shares = alternated(Loader(one, args.batch_size, seed=0), Loader(mixture, args.batch_size, seed=0), args.rounds,
                        say=lambda line: print(line, flush=True))
    print(f"the mixture against one dataset: median {100 * statistics.median(shares):.0f}% "
          f"({100 * min(shares):.0f}-{100 * max(shares):.0f}%) over {args.rounds} rounds")


if __name__ == "__main__":
    main()
