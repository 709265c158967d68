"""One rank of a torchrun job under `bench doctor` (`ranks`): torchrun runs
`python -m bench.doctor.rank SCRIPT ARGS` in place of `python SCRIPT ARGS`, and the script runs
as it would, watched, its report written as rank-<RANK>.json in the doctor's folder."""

import sys

from bench.doctor.child import child_main

if __name__ == "__main__":
    # `python -m` put the working directory first on the path; `python SCRIPT` puts the script's
    # folder there instead (its sibling modules import): "" is what child_main makes it
    sys.path[0] = ""
    child_main(sys.argv[1:])
