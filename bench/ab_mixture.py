"""A Mixture of 3 datasets against one dataset of the same total (issue 35's "at least 95%"),
alternated in one process: the crops of `bench loaders` built whole and cut in three datasets
with every class folder in each (so their labels mean the same classes), `Loader(ds, 256)` with
default threads, the best of 4 passes of each per round.

    python -m bench.ab_mixture --work /tmp/brw [--images 3000] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def best_rate(loader, passes: int = 4) -> float:
    """Images/s of the best of `passes` passes of `loader`."""
    best = 0.0
    for _ in range(passes):
        start = time.perf_counter()
        n = sum(len(b["label"]) for b in loader)
        best = max(best, n / (time.perf_counter() - start))
    return best


def alternated(one, other, rounds: int, say=None) -> list[float]:
    """`other`'s rate over `one`'s (Loaders), each the best of 4 passes, in `rounds` rounds that
    alternate them: a shared machine's load moves both alike, where two rows timed minutes
    apart differ by more than the gap measured."""
    best_rate(one), best_rate(other)  # first maps, allocations
    shares = []
    for r in range(rounds):
        a, b = best_rate(one), best_rate(other)
        shares.append(b / a)
        if say:
            say(f"round {r}: one dataset {a:,.0f} images/s, the mixture {b:,.0f} = {100 * b / a:.0f}%")
    return shares


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.ab_mixture", description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="raw and built data, made once and reused")
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=256)
    args = ap.parse_args(argv)
    from loaders import Mixture, MMapDataset

    from .loaders_bench import prepare_image_thirds, prepare_images

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
