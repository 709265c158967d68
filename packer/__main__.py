"""`packer` (the console script) and `python -m packer`: the command line (`packer.cli`), with
OpenBLAS kept to one thread in this process and the build's workers (`packer._one_blas_thread`),
set before numpy is first imported. Importing a module of packer sets nothing."""

import sys


def main() -> int:
    from packer import _one_blas_thread  # noqa: F401  first: before numpy is imported
    from packer.cli import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
