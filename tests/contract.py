"""The resume contract, shared by every reader: the readers built the same way in the test and in
a process of its own (`python -m tests.contract`, a JSON line of jobs in on stdin, a line of
results out on stdout), and the
README's training loop that drives them.

A batch is told by the identity of its samples: the image keys, or a digest of each token row
(with its labels, for conversations).
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from loaders import (AudioClips, BatchedDataset, Loader, Mixture, MMapDataset, MMapIterableDataset, PackedDocuments, StatefulDataLoader,
                     TokenWindows)

BATCH = 8
EPOCHS = 3
READERS = ("Loader(images)", "Loader(TokenWindows)", "Loader(PackedDocuments)", "StatefulDataLoader(batched)",
           "StatefulDataLoader(MMapIterableDataset)", "StatefulDataLoader(TokenWindows)",
           "StatefulDataLoader(PackedDocuments)", "Loader(Mixture)", "StatefulDataLoader(Mixture)",
           "Loader(images, bucket_by)", "StatefulDataLoader(batched, bucket_by)", "Loader(audio)",
           "Loader(AudioClips)", "StatefulDataLoader(AudioClips)", "Loader(jpeg)", "StatefulDataLoader(jpeg, bucket_by)",
           "Loader(audio, bucket_by length)", "StatefulDataLoader(pairs, max_tokens)", "Loader(PackedDocuments chat)",
           "StatefulDataLoader(PackedDocuments chat)")
PLANNED = ("Loader(audio, bucket_by length)", "StatefulDataLoader(pairs, max_tokens)")  # batches of varying sizes


def opened(paths: dict, key: str, **kwargs) -> MMapDataset:
    """The dataset `key` of `paths` (a dir, or an s3:// URL read through a cache of
    paths["cache_limit"] bytes when it names one)."""
    if paths.get("cache_limit"):
        kwargs["cache_limit"] = paths["cache_limit"]
    return MMapDataset(paths[key], **kwargs)


def mixture(paths: dict) -> Mixture:
    """The text dataset and the pairs dataset's tokens, 2 to 1."""
    return Mixture([opened(paths, k, columns=["tokens", "key"]) for k in ("text", "pairs")], [2, 1])


def make(reader: str, paths: dict, *, world: int, rank: int, par: int):
    """Reader `reader` over the test datasets for one rank; `par` is the Loader's thread count
    or the DataLoader's worker count."""
    common = dict(seed=5, rank=rank, world_size=world)
    windows = lambda: TokenWindows(paths["text"], 256)  # noqa: E731
    packed = lambda: PackedDocuments(paths["text"], 512)  # noqa: E731
    chat = lambda: PackedDocuments(paths["chat"], 256)  # noqa: E731  conversations: tokens and their labels
    if reader == "Loader(images)":
        return Loader(opened(paths, "images", columns=["label", "key"]), BATCH, num_threads=par, **common)
    if reader == "Loader(TokenWindows)":
        return Loader(windows(), BATCH, num_threads=par, **common)
    if reader == "Loader(PackedDocuments)":
        return Loader(packed(), BATCH, num_threads=par, **common)
    if reader == "Loader(PackedDocuments chat)":
        return Loader(chat(), BATCH, num_threads=par, **common)
    if reader == "Loader(Mixture)":
        return Loader(mixture(paths), BATCH, num_threads=par, **common)
    if reader == "Loader(audio)":
        return Loader(opened(paths, "audio"), BATCH, num_threads=par, **common)
    if reader == "Loader(AudioClips)":
        return Loader(AudioClips(paths["audio"], 0.5, seed=9), BATCH, num_threads=par, **common)
    if reader == "Loader(jpeg)":  # the JPEG lane's images decoded in the Loader's threads
        return Loader(opened(paths, "jpeg", columns=["image", "key"]), BATCH, num_threads=par, **common)
    if reader == "Loader(audio, bucket_by length)":  # whole clips, of about one length a batch
        return Loader(opened(paths, "audio", columns=["audio", "key"]), BATCH, num_threads=par, bucket_by="length",
                      **common)
    if reader == "Loader(images, bucket_by)":
        return Loader(opened(paths, "aspect", columns=["image", "key"]), BATCH, num_threads=par, bucket_by="aspect",
                      **common)
    if reader == "StatefulDataLoader(batched)":
        source = opened(paths, "images", columns=["label", "key"]).batched(BATCH, **common)
    elif reader == "StatefulDataLoader(MMapIterableDataset)":
        limit = {"cache_limit": paths["cache_limit"]} if paths.get("cache_limit") else {}
        source = MMapIterableDataset(paths["images"], chunk=BATCH, columns=["label", "key"], **common, **limit)
    elif reader == "StatefulDataLoader(TokenWindows)":
        source = BatchedDataset(windows(), BATCH, **common)
    elif reader == "StatefulDataLoader(Mixture)":
        source = BatchedDataset(mixture(paths), BATCH, **common)
    elif reader == "StatefulDataLoader(AudioClips)":
        source = BatchedDataset(AudioClips(paths["audio"], 0.5, seed=9), BATCH, **common)
    elif reader == "StatefulDataLoader(batched, bucket_by)":
        source = opened(paths, "aspect", columns=["image", "key"]).batched(BATCH, bucket_by="aspect", **common)
    elif reader == "StatefulDataLoader(pairs, max_tokens)":  # captions, as many as fit 96 padded tokens
        source = opened(paths, "pairs", columns=["tokens", "key"]).batched(max_tokens=96, **common)
    elif reader == "StatefulDataLoader(jpeg, bucket_by)":  # ... in DataLoader workers, each its own threads
        source = opened(paths, "jpeg_aspect", columns=["image", "key"]).batched(BATCH, bucket_by="aspect", **common)
    elif reader == "StatefulDataLoader(PackedDocuments chat)":
        source = BatchedDataset(chat(), BATCH, **common)
    else:
        source = BatchedDataset(packed(), BATCH, **common)
    return StatefulDataLoader(source, num_workers=par)


def samples(batch) -> list[str]:
    """The identities of a batch's samples, in order (an audio sample's: its key and a digest of
    its frames, which tell one crop of a clip from another; an image's read with its key: the key
    and a digest of its pixels, which a resumed batch must give again)."""
    if isinstance(batch, dict) and "audio" in batch:
        return [f"{key}@{_digest(row[:n])}" for key, row, n in zip(batch["key"], batch["audio"],
                                                                 batch["audio_lengths"].tolist())]
    if isinstance(batch, dict) and "image" in batch and "key" in batch:
        sizes = batch["image_size"].tolist() if "image_size" in batch else [None] * len(batch["key"])
        return [f"{key}@{_digest(image if hw is None else image[:hw[0], :hw[1]])}"
                for key, image, hw in zip(batch["key"], batch["image"], sizes)]
    if isinstance(batch, dict) and "key" in batch:
        return list(batch["key"])
    if isinstance(batch, dict) and "labels" in batch:  # a conversation's row: its tokens and what it trains on
        return [_digest(torch.stack([row, labels])) for row, labels in zip(batch["tokens"], batch["labels"])]
    rows = batch["tokens"] if isinstance(batch, dict) else torch.cat([batch[0], batch[1][:, -1:]], dim=1)
    return [hashlib.blake2b(row.numpy().tobytes(), digest_size=8).hexdigest() for row in rows]


def _digest(row) -> str:
    return hashlib.blake2b(row.numpy().tobytes(), digest_size=8).hexdigest()


def train(loader, *, first_epoch: int = 0, stop_after: int | None = None):
    """The README's loop: set_epoch at the top of every epoch. Returns ([(epoch, samples of each
    batch)], the state after the last batch taken): `stop_after` batches, or EPOCHS epochs."""
    seen = []
    for epoch in range(first_epoch, EPOCHS):
        loader.set_epoch(epoch)
        for batch in loader:
            seen.append((epoch, samples(batch)))
            if len(seen) == stop_after:
                return seen, loader.state_dict()
    return seen, loader.state_dict()


def resume(reader: str, paths: dict, *, world: int, rank: int, par: int, state: dict):
    """A new reader loads the state, then the loop goes on from the state's epoch."""
    loader = make(reader, paths, world=world, rank=rank, par=par)
    loader.load_state_dict(state)
    return train(loader, first_epoch=state["epoch"])[0]


def main() -> None:
    """Each line of stdin a JSON list of jobs, answered by a line of their results: one process
    resumes the jobs of many tests (none of which ran in it before), not an interpreter and
    torch started for each."""
    for line in sys.stdin:
        print(json.dumps([resume(**job) for job in json.loads(line)]), flush=True)


if __name__ == "__main__":
    main()
