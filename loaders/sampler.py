"""Orders, rank/worker shares and the resumable cursor: pure functions of integers.

An epoch's global order is a permutation of the sample ids, a function of (seed, epoch) only.
The `cursor` counts samples of that order already consumed by all ranks together. From any
cursor, the remaining order is dealt to ranks interleaved (rank r takes remaining[r::W]), so a
resumed run, with the same or another world size, covers each remaining sample once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import numpy as np

Order = Literal["random", "sequential", "block"]
ORDERS = ("random", "sequential", "block")


def epoch_order(num_samples: int, *, order: Order, seed: int, epoch: int,
                block_size: int = 1024, window: int = 8192) -> np.ndarray:
    """The epoch's global order, int64 [num_samples].

    `block`: for data larger than RAM. Shuffle blocks of `block_size` consecutive ids, then
    shuffle ids inside consecutive windows of `window` ids of that sequence: every read stays
    within a few blocks, so disk access is near-sequential.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
    if order == "sequential":
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    if order == "random":
        return rng.permutation(num_samples).astype(np.int64)
    starts = rng.permutation(np.arange(0, num_samples, block_size))
    ids = np.concatenate([np.arange(s, min(s + block_size, num_samples)) for s in starts]) if num_samples else \
        np.zeros(0, np.int64)
    for lo in range(0, num_samples, window):
        rng.shuffle(ids[lo:lo + window])
    return ids.astype(np.int64)


def rank_share(order: np.ndarray, cursor: int, *, rank: int, world_size: int, batch_size: int,
               drop_last: bool) -> np.ndarray:
    """Rank's ids from `cursor` on. Every rank gets the same count: with drop_last the
    remainder is cut to whole global batches, else the tail is padded by repeating the order's
    first ids (as DistributedSampler does)."""
    remaining = order[cursor:]
    if drop_last:
        keep = len(remaining) // (world_size * batch_size) * (world_size * batch_size)
        remaining = remaining[:keep]
    else:
        per_rank = -(-len(remaining) // world_size)
        pad = per_rank * world_size - len(remaining)
        if pad:
            remaining = np.concatenate([remaining, np.resize(order, pad)])
    return remaining[rank::world_size]


def worker_batches(num_batches: int, worker_id: int, num_workers: int) -> range:
    """Batch numbers a DataLoader worker makes: DataLoader takes batches from its workers in
    round-robin, so batch b from worker b % K keeps the global order whatever K is."""
    return range(worker_id, num_batches, num_workers)


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")


def resolve_topology(rank: int | None = None, world_size: int | None = None) -> Topology:
    """Explicit arguments, else torch.distributed when initialised, else RANK / WORLD_SIZE,
    else a single process."""
    if rank is not None or world_size is not None:
        return Topology(rank or 0, world_size or 1)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return Topology(dist.get_rank(), dist.get_world_size())
    except ImportError:
        pass
    return Topology(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


class EpochPlan:
    """The state around the functions above, shared by Loader, BatchedDataset and
    MMapIterableDataset: order, seed, epoch, this rank's place, and the cursor."""

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool, order: Order | None, seed: int,
                 drop_last: bool, rank: int | None, world_size: int | None):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        topo = resolve_topology(rank, world_size)
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.order = order or ("random" if shuffle else "sequential")
        self.drop_last, self.rank, self.world_size = drop_last, topo.rank, topo.world_size
        self.epoch = 0
        self.cursor = 0

    def share(self) -> np.ndarray:
        """This rank's sample ids of the current epoch from the cursor on."""
        ids = epoch_order(self.num_samples, order=self.order, seed=self.seed, epoch=self.epoch)
        return rank_share(ids, self.cursor, rank=self.rank, world_size=self.world_size,
                          batch_size=self.batch_size, drop_last=self.drop_last)

    def num_batches(self, share: np.ndarray) -> int:
        return -(-len(share) // self.batch_size)

    def state_dict(self) -> dict:
        """A few integers: enough to resume exactly, whatever the worker or thread count."""
        return {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor, "order": self.order}

    def load_state_dict(self, state: dict) -> None:
        if state["order"] != self.order or state["seed"] != self.seed:
            raise ValueError(f"state is for order={state['order']} seed={state['seed']}, "
                             f"this loader has order={self.order} seed={self.seed}")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])

    def advance(self, batches: int) -> None:
        """Move the cursor past `batches` batches of every rank (global samples)."""
        self.cursor = min(self.cursor + batches * self.batch_size * self.world_size, self.num_samples)
