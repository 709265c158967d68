"""Imported by the pool's forkserver before anything else it preloads (numpy among them).

OpenBLAS starts a thread per core when numpy is imported and keeps them spinning until its
fork handler stops them at the server's first fork: some 75 ms of a core, taken from the
build's first decoding lane while the pool starts. No pool worker calls BLAS: one thread is
enough. A value the user has set is kept.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
