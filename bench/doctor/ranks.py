"""Every rank of a `torchrun` job: the doctor runs torchrun itself, with each rank's script run by
`python -m bench.doctor.rank` (the script as torchrun would run it, watched), each rank writing
a report of its own; then the job's figures from all of them.

In a job whose ranks meet in a collective each step (DDP's gradient all-reduce), the slowest
rank sets every rank's pace: the straggler waits for its data, and the others wait for it inside
the collective, which their clock counts as step. So the straggler is the rank that waits most
for data, and what it costs the others is their step time past its own (their time in the
collective waiting for it). The job's verdict is the straggler's loop.

Each rank watches its loop only (no loader measured alone after it: the ranks' measures would
share the node's cores, and the fixes it names are estimates); `bench doctor -- python
train.py` on one rank measures them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .report import RankFigures, Ranks, Report, read_report
from .rerun import rate
from .verdict import DATA_BOUND

RANK_MODULE = "bench.doctor.rank"
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def torchrun_command(command: list[str]) -> list[str] | None:
    """`command` as the doctor runs it where it is `torchrun OPTIONS SCRIPT ARGS` (or `-m MODULE`,
    or `python -m torch.distributed.run ...`): torchrun's own options kept, the script run by
    RANK_MODULE; None where it is no torchrun."""
    if not command:
        return None
    name = Path(command[0]).name
    if name == "torchrun":
        rest = command[1:]
    elif name.startswith("python") and len(command) > 2 and command[1] == "-m" and command[2] in LAUNCHER_MODULES:
        rest = command[3:]
    else:
        return None
    from torch.distributed.run import get_args_parser

    try:
        args = get_args_parser().parse_args(rest)
    except SystemExit as exc:
        raise SystemExit(f"bench doctor: torchrun cannot read {' '.join(rest)}") from exc
    if args.no_python:
        raise SystemExit("bench doctor: torchrun --no-python runs no Python script the doctor can watch: give the "
                         "script (torchrun OPTIONS train.py ARGS)")
    at = len(rest) - len(args.training_script_args) - 1
    options = [o for o in rest[:at] if o not in ("-m", "--module")]
    target = ["-m", args.training_script] if args.module else [args.training_script]
    return [sys.executable, "-m", "torch.distributed.run", *options, "-m", RANK_MODULE, *target,
            *args.training_script_args]


def figures(rank: int, r: Report) -> RankFigures:
    steps = r.loop.per_step if r.loop else []
    n = max(len(steps), 1)
    return RankFigures(rank=rank, batches=r.batches or 0, wait_share=r.loop.wait_share if r.loop else None,
                       wait_ms=sum(s.wait_ms for s in steps) / n, step_ms=sum(s.step_ms for s in steps) / n,
                       steps_per_s=rate(steps), error=r.run.error if r.run else None)


def job(reports: dict[int, Report]) -> tuple[Report | None, Ranks | None]:
    """The straggler's report, and the job's figures by rank (None: no rank left a report)."""
    ranked = {k: figures(k, r) for k, r in sorted(reports.items())}
    looped = [f for f in ranked.values() if f.wait_share is not None]
    if not looped:
        return (next(iter(reports.values()), None), None)
    slow = max(looped, key=lambda f: f.wait_ms)
    others = [f for f in looped if f.rank != slow.rank]
    held = sum(max(0.0, f.step_ms - slow.step_ms) for f in others) / len(others) if others else 0.0
    ranks = Ranks(ranks=list(ranked.values()), straggler=slow.rank, held_ms_per_step=held)
    return reports[slow.rank], ranks


def verdict(ranks: Ranks, straggler: Report) -> str:
    """The job's verdict: the straggler's, with what it costs the other ranks."""
    slow = next(f for f in ranks.ranks if f.rank == ranks.straggler)
    n = len(ranks.ranks)
    if (slow.wait_share or 0.0) <= DATA_BOUND:
        return f"compute-bound, all {n} ranks: rank {slow.rank} waits most, {100 * (slow.wait_share or 0):.0f}% of its loop; " \
            + straggler.verdict
    fast = min(ranks.ranks, key=lambda f: f.wait_ms)
    return (f"data-bound on rank {slow.rank} of {n}, which holds the job: it waits {slow.wait_ms:.1f} ms a step for "
            f"its data ({100 * slow.wait_share:.0f}% of its loop; rank {fast.rank} {fast.wait_ms:.1f} ms), and the other "
            f"rank(s) wait about {ranks.held_ms_per_step:.1f} ms a step in the collective for it. Rank "
            f"{slow.rank}'s loop: {straggler.verdict}")


def read_all(folder: Path) -> dict[int, Report]:
    out = {}
    for path in sorted(folder.glob("rank-*.json")):
        try:
            out[int(path.stem.split("-", 1)[1])] = read_report(path)
        except (ValueError, OSError):
            continue
    return out

