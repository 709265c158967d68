"""Imported before numpy by the `packer` command (`packer.__main__`) and by the pool's
forkserver (first of what it preloads): processes of the build's own, never by a library import.

OpenBLAS starts a thread per core when numpy is imported and keeps them spinning for a while
(in the server, until its fork handler stops them at its first fork): CPU taken from the
build's decoding lanes or tokenizer threads while the build starts, the more so the more cores.
The packer never calls BLAS: one thread is enough. A value the user
has set is kept.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
