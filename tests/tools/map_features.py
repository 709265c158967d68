"""A function for `packer.map` tests: real-looking features of varying length, a skip, a
failure, a list of two samples; with MMPACK_TEST_KILL_AT=i the map process is killed (SIGKILL)
when item i comes up, wherever it runs. It imports nothing of mmpack."""

import os
import signal

import numpy as np


def features(i: int):
    if str(i) == os.environ.get("MMPACK_TEST_KILL_AT"):
        os.kill(int(os.environ["MMPACK_TEST_MAP_PID"]), signal.SIGKILL)
    if i % 13 == 4:
        return None
    if i % 17 == 6:
        raise ValueError(f"item {i} is damaged")
    rng = np.random.default_rng(i)
    sample = {"feat": rng.standard_normal((1 + i % 9, 16)).astype(np.float16), "f0": rng.random(1 + i % 9,
                                                                                            dtype=np.float32),
              "speaker": f"spk{i % 5}"}
    return [sample, {**sample, "key": f"{i}:copy"}] if i % 19 == 0 else sample


if __name__ == "__main__":
    import sys

    import packer

    out, workers = sys.argv[1], int(sys.argv[2])
    os.environ["MMPACK_TEST_MAP_PID"] = str(os.getpid())  # what a kill test kills, from any worker
    packer.map(features, list(range(int(sys.argv[3]))), out, workers=workers, shard_size="2KB", chunk=16)
