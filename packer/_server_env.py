"""Imported by the pool's forkserver before anything else it preloads (numpy among them).

OpenBLAS starts a thread per core when numpy is imported and keeps them spinning for a while
after. In the forkserver those threads would make the server a multi-threaded process that
forks every worker (the very thing a forkserver is there to avoid) and take a core from the
build's first decoding lane while it starts. No pool worker calls BLAS: one thread is enough.
A value the user has set is kept.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
