"""Imported before numpy by the `packer` command and by the pool's forkserver (first of what
it preloads).

OpenBLAS starts a thread per core when numpy is imported and keeps them spinning for about
0.1 s of a core each (in the server, until its fork handler stops them at its first fork):
taken from the build's decoding lanes or tokenizer threads while the build starts (4% of the
CPU of a 1.2 s text build). The packer never calls BLAS: one thread is enough. A value the user
has set is kept.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
