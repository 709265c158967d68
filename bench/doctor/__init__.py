"""`bench doctor`: whether a training script's GPU (or CPU) waits for data, why, and what to try.

    bench doctor [--steps 50] [--json R.json] [--plot R.png] -- python train.py ARGS...
    with bench.doctor.watch(loader) as w:   # a loop that is not a script
        for batch in loader: ...
    print(w.report()["verdict"])
    bench.stall(loader, step_ms=20)         # a loop with a stand-in step of 20 ms: the same figures

The script runs unmodified in a child process (nothing of mmpack imported by it), with every
`torch.utils.data.DataLoader` and mmpack `Loader` it iterates watched: how long each `next()`
blocks (waiting for data) and how long the script works between batches (the step). After
`--steps` batches, or when the script ends or fails, the loader it iterated most is measured
alone for a few batches (its ceiling without the model), and for a map-style dataset the cost of
one `__getitem__` and of the collate. A partial run still gives its report.

A module a stage: `hooks`, `watching`, `processes` and `gpu` watch the loop from inside;
`command` and `child` run the script in a child process; `probes` time the loader alone and one
sample; `trials` measure the fixes; `verdict` judges; `diagnosis` makes them one typed
`report.Report`, which `codec` writes to JSON and reads back; `plotting` draws it; `stand_in`
times a loop with a stand-in step (`stall`).
"""

from . import command, probes, trials, verdict
from .child import child_main, run
from .codec import to_json
from .command import python_command
from .gpu import Copies, CudaMarks, Nvml
from .plotting import plot
from .processes import Processes
from .report import Report, read_report, write_report
from .stand_in import stall
from .trials import BUCKET_PADDING
from .verdict import DATA_BOUND, text
from .watching import Watch, watch

__all__ = ["BUCKET_PADDING", "DATA_BOUND", "Copies", "CudaMarks", "Nvml", "Processes", "Report", "Watch", "child_main",
           "plot", "python_command", "read_report", "run", "stall", "text", "to_json", "watch", "write_report"]

# the stages' functions by the names tests/test_doctor.py has always called them
_ceiling, _per_sample = probes.ceiling, probes.per_sample
_clone, _persistent, _loader_alternatives = trials.clone, trials.persistent, trials.loader_alternatives
_interpreter, _verdict = command.interpreter, verdict.decide_json
