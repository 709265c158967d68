"""One resume contract for every reader (tests/contract.py): save after k batches, resume in a
fresh process with another thread or worker count, and the batches go on exactly as the
uninterrupted run's, through epoch boundaries, with set_epoch called as in the README; every
sample of an epoch comes once across ranks; a state from another world size resumes elastically."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from loaders import Loader, MMapDataset, PackedDocuments, TokenWindows
from tests import contract

ROOT = Path(__file__).resolve().parents[2]


def fresh_process(jobs: list[dict]) -> list:
    """Run contract.resume for each job in a new Python process."""
    out = subprocess.run([sys.executable, "-m", "tests.contract"], input=json.dumps(jobs), capture_output=True,
                         text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [[(epoch, batch) for epoch, batch in run] for run in json.loads(out.stdout)]


def every_sample(reader: str, paths: dict) -> Counter:
    """The identity of every sample of the reader's dataset, once."""
    if "Mixture" in reader:
        return Counter(k for ds in (MMapDataset(paths[k], columns=["key"]) for k in ("text", "pairs"))
                       for k in (ds[i]["key"] for i in range(len(ds))))
    if "images" in reader or "batched" in reader or "MMapIterable" in reader:
        return Counter(MMapDataset(paths["images"])[i]["key"] for i in range(len(MMapDataset(paths["images"]))))
    view = TokenWindows(paths["text"], 256) if "TokenWindows" in reader else PackedDocuments(paths["text"], 512)
    loader = Loader(view, contract.BATCH, shuffle=False)
    return Counter(s for batch in loader for s in contract.samples(batch))


@pytest.mark.parametrize("reader", contract.READERS)
def test_resume_in_a_fresh_process_goes_on_with_the_next_batch(built, reader):
    paths = {k: str(v) for k, v in built.items()}
    everything = every_sample(reader, paths)
    pars = (0, 2) if reader.startswith("Stateful") else (1, 2)  # DataLoader workers, or Loader threads
    jobs, expected = [], []
    for world in (1, 2):
        full = [contract.train(contract.make(reader, paths, world=world, rank=r, par=pars[0]))[0] for r in range(world)]
        per_epoch = len(full[0]) // contract.EPOCHS
        for epoch in range(contract.EPOCHS):  # every sample once per epoch across ranks (padding aside)
            got = Counter(s for run in full for e, batch in run if e == epoch for s in batch)
            if "Mixture" in reader:  # a stream by weight (its shares: tests/loaders/test_mixture.py)
                assert set(got) <= set(everything) and sum(got.values()) == world * -(-len(contract.mixture(paths)) // world)
                continue
            assert set(got) == set(everything) and sum(got.values()) - sum(everything.values()) < world
        for i, stop in enumerate((per_epoch + 1, per_epoch, 2 * per_epoch - 1)):  # mid-epoch, at a boundary, ...
            for rank in range(world):
                head, state = contract.train(contract.make(reader, paths, world=world, rank=rank, par=pars[1]),
                                             stop_after=stop)
                assert head == full[rank][:stop]
                jobs.append(dict(reader=reader, paths=paths, world=world, rank=rank, par=pars[i % 2], state=state))
                expected.append(full[rank][stop:])
    tails = fresh_process(jobs)
    for job, tail, want in zip(jobs, tails, expected):
        assert tail == want, (job["world"], job["rank"], job["state"])


@pytest.mark.parametrize("reader", ["Loader(images)", "StatefulDataLoader(batched)", "Loader(images, bucket_by)"])
def test_a_state_saved_on_two_ranks_resumes_on_one_and_on_three(built, reader):
    """Elastic: two ranks take some batches; one rank (or three) resumes from the state and the
    epoch is covered once, the padding at its very end aside."""
    paths = {k: str(v) for k, v in built.items()}
    everything = every_sample(reader, paths)
    heads, states = [], []
    for rank in range(2):
        head, state = contract.train(contract.make(reader, paths, world=2, rank=rank, par=2), stop_after=3)
        heads += [s for _, batch in head for s in batch]
        states.append(state)
    assert states[0] == states[1]
    for world in (1, 3):
        tails = fresh_process([dict(reader=reader, paths=paths, world=world, rank=r, par=0 if "Stateful" in reader else 1,
                                    state=states[0]) for r in range(world)])
        epoch0 = heads + [s for run in tails for e, batch in run if e == 0 for s in batch]
        got = Counter(epoch0)
        assert set(got) == set(everything) and sum(got.values()) - len(everything) < world
        assert max(got.values()) <= 2
