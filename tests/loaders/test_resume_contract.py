"""One resume contract for every reader (tests/contract.py): save after k batches, resume in a
process that never ran the saving loader (one such process serves a test process's tests:
`_Resumer`), with another thread or worker count, and the batches go on exactly as the
uninterrupted run's, through epoch boundaries, with set_epoch called as in the README; every
sample of an epoch comes once across ranks; a state from another world size resumes elastically."""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from loaders import Loader, MMapDataset, MMapIterableDataset, PackedDocuments, StatefulDataLoader, TokenWindows
from packer.errors import ConfigError
from tests import contract

ROOT = Path(__file__).resolve().parents[2]


class _Resumer:
    """A Python process of its own (`python -m tests.contract`) that resumes the jobs it is sent:
    never the process that saved their states. One serves the tests of this test process while
    the environment it was started with holds (a URL's credentials and endpoint are in it)."""

    def __init__(self):
        self.proc, self.env, self.log = None, None, None

    def run(self, jobs: list[dict]) -> list:
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's, set for every test
        if self.proc is None or self.proc.poll() is not None or env != self.env:
            self.close()
            self.log = tempfile.TemporaryFile("w+")  # not a pipe: a chatty process would fill it and stall
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.contract"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT, env=env)
            self.env = env
        self.proc.stdin.write(json.dumps(jobs) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], 600)[0]:  # its answer is a line: nothing buffered before it
            self.proc.kill()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            self.log.seek(0)
            raise AssertionError(f"the resuming process exited {self.proc.returncode}: {self.log.read()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.log.close()
        self.proc = None


_resumer = _Resumer()
atexit.register(_resumer.close)


def fresh_process(jobs: list[dict]) -> list:
    """contract.resume for each job, in a process that never ran the loaders that saved them."""
    return [[(epoch, batch) for epoch, batch in run] for run in _resumer.run(jobs)]


def every_sample(reader: str, paths: dict) -> Counter:
    """The identity of every sample of the reader's dataset, once."""
    if "Mixture" in reader:
        return Counter(k for ds in (MMapDataset(paths[k], columns=["key"]) for k in ("text", "pairs"))
                       for k in (ds[i]["key"] for i in range(len(ds))))
    if "pairs" in reader:  # the captions' keys
        return Counter(k for ds in [MMapDataset(paths["pairs"], columns=["key"])] for k in (ds[i]["key"] for i in range(len(ds))))
    if "audio" in reader or "AudioClips" in reader:  # each clip once an epoch (its crop differs by epoch)
        return Counter(MMapDataset(paths["audio"])[i]["key"] for i in range(len(MMapDataset(paths["audio"]))))
    if "images" in reader or "batched" in reader or "MMapIterable" in reader or "jpeg" in reader:  # one RAW's keys
        return Counter(MMapDataset(paths["images"])[i]["key"] for i in range(len(MMapDataset(paths["images"]))))
    view = (TokenWindows(paths["text"], 256) if "TokenWindows" in reader else
            PackedDocuments(paths["chat"], 256) if "chat" in reader else PackedDocuments(paths["text"], 512))
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
            got = Counter(s.rsplit("@", 1)[0] if "@" in s else s  # audio, images: the key, less its digest
                          for run in full for e, batch in run if e == epoch for s in batch)
            if "Mixture" in reader:  # a stream by weight (its shares: tests/loaders/test_mixture.py)
                assert set(got) <= set(everything) and sum(got.values()) == world * -(-len(contract.mixture(paths)) // world)
                continue
            assert set(got) == set(everything) and sum(got.values()) - sum(everything.values()) < world * _most(reader, full)
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


def _most(reader: str, runs) -> int:
    """How many samples one batch of padding repeats at most: one (the tail is dealt a sample at
    a time), or for batches planned by length (the last round made whole by repeating batches)
    the largest batch."""
    return max(len(batch) for run in runs for _, batch in run) if reader in contract.PLANNED else 1


@pytest.mark.parametrize("reader", ["Loader(images)", "StatefulDataLoader(batched)", "Loader(images, bucket_by)",
                                    "Loader(jpeg)", "Loader(audio, bucket_by length)"])
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
        got = Counter(s.rsplit("@", 1)[0] for s in epoch0)  # images: the key, less its pixels' digest
        assert set(got) == set(everything) and sum(got.values()) - len(everything) < world * _most(reader, [tails[0]])
        assert max(got.values()) <= 2


# (what the saving loader had, what the loading one has, what the one-line error says)
REFUSED = [
    (dict(seed=1), dict(seed=2), "seed 1, this loader has 2"),
    (dict(order="random"), dict(order="block"), "order 'random', this loader has 'block'"),
    (dict(drop_last=True), dict(), "drop_last=True, this loader has drop_last=False"),
    (dict(), dict(drop_last=True), "drop_last=False, this loader has drop_last=True"),
    (dict(bucket_by="aspect"), dict(), "bucket_by='aspect'.* this loader has bucket_by=None"),
    (dict(), dict(bucket_by="aspect"), "bucket_by=None, this loader has bucket_by='aspect'"),
    (dict(bucket_by="aspect"), dict(bucket_by="aspect", batch_size=5), "batch_size 8, this loader's 5"),
]
# what a state resumes across (exactly: the contract tests above and tests/loaders/test_sampler.py)
ACCEPTED = [
    (dict(), dict(batch_size=5, num_threads=1)),
    (dict(world_size=2, rank=1), dict(world_size=3, rank=0)),
    (dict(bucket_by="aspect", world_size=2, rank=0), dict(bucket_by="aspect", num_threads=1)),
    (dict(drop_last=True, order="block"), dict(drop_last=True, order="block", batch_size=3, world_size=2, rank=1)),
]


def _loader(ds, options: dict) -> Loader:
    options = {"batch_size": 8, "seed": 1, **options}
    return Loader(ds, options.pop("batch_size"), **options)


def _state_after_two_batches(loader) -> dict:
    it = iter(loader)
    next(it)
    next(it)
    return loader.state_dict()


@pytest.mark.parametrize("saved,loading,says", REFUSED, ids=[r[2].split(",")[0] for r in REFUSED])
def test_a_state_of_another_order_is_refused_saying_what_differs(built, saved, loading, says):
    """Everything the order depends on is in the state and compared: a loader whose order would
    differ refuses the state in one line naming the option, rather than resume somewhere else."""
    ds = MMapDataset(built["aspect"], columns=["image", "key"])
    state = _state_after_two_batches(_loader(ds, saved))
    with pytest.raises(ConfigError, match=says) as got:
        _loader(ds, loading).load_state_dict(state)
    assert "\n" not in str(got.value)


@pytest.mark.parametrize("saved,loading", ACCEPTED)
def test_a_state_loads_where_only_threads_ranks_or_an_ungrouped_batch_size_differ(built, saved, loading):
    """...and the loaded loader stands where the saved one stopped: each rank of the saved world
    takes two batches and saves the same state, its cursor the samples they all took; each rank of
    the loaded world goes on from there to the epoch's end, with the samples none of them took:
    every sample once, but for a rank's padding (a repeat) and the tail drop_last leaves."""
    ds = MMapDataset(built["aspect"], columns=["image", "key"])
    taken, states = Counter(), []
    for saver in _ranks(ds, saved):
        it = iter(saver)
        taken.update(k for _ in range(2) for k in next(it)["key"])
        states.append(saver.state_dict())
    state = states[0]
    assert all(s == state for s in states) and state["cursor"] == sum(taken.values()) > 0
    rest = Counter()
    for loader in _ranks(ds, loading):
        loader.load_state_dict(state)
        again = loader.state_dict()
        assert (again["epoch"], again["cursor"]) == (state["epoch"], state["cursor"])
        rest.update(k for batch in loader for k in batch["key"])
        assert loader.epoch == state["epoch"] + 1  # the epoch's end came
    world, once = loading.get("world_size", 1), Counter(ds[i]["key"] for i in range(len(ds)))
    assert sum((taken + rest - once).values()) < world  # a repeat a rank at most, to even the ranks out
    left = len(once.keys() - taken.keys() - rest.keys())
    assert left < (world * loading.get("batch_size", 8) if loading.get("drop_last") else 1), left


def _ranks(ds, options: dict) -> list[Loader]:
    """A loader so for each rank of its world size."""
    return [_loader(ds, {**options, "rank": rank}) for rank in range(options.get("world_size", 1))]


@pytest.mark.parametrize("reader", ["Loader(TokenWindows)", "Loader(PackedDocuments)", "Loader(Mixture)",
                                    "StatefulDataLoader(MMapIterableDataset)"])
def test_every_view_refuses_a_state_of_another_drop_last(built, reader):
    paths = {k: str(v) for k, v in built.items()}

    def make(drop_last: bool):
        if reader == "StatefulDataLoader(MMapIterableDataset)":
            iterable = MMapIterableDataset(paths["images"], chunk=4, columns=["key"], drop_last=drop_last)
            return StatefulDataLoader(iterable)
        view = {"Loader(TokenWindows)": lambda: TokenWindows(paths["text"], 64),
                "Loader(PackedDocuments)": lambda: PackedDocuments(paths["text"], 128),
                "Loader(Mixture)": lambda: contract.mixture(paths)}[reader]()
        return Loader(view, 4, seed=2, drop_last=drop_last)

    state = _state_after_two_batches(make(True))
    make(True).load_state_dict(state)
    with pytest.raises(ConfigError, match="drop_last=True, this loader has drop_last=False"):
        make(False).load_state_dict(state)
