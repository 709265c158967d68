"""The script run in a child process: `run` starts it and reads back its report; `child_main`,
in the child, runs it as python would, as __main__, with its loaders watched, and writes the report."""

from __future__ import annotations

import builtins
import importlib.util
import io
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import zipfile
from contextlib import contextmanager
from pathlib import Path

from .command import interpreter, python_command
from .deadline import DEADLINE_ENV, STALLED_EXIT, Watchdog
from .hooks import loader_classes, patched
from .report import Report, read_report, write_report
from .ranks import job as ranks_job, read_all, torchrun_command, verdict as job_verdict
from .rerun import REPLAY_ENV, confirmed, overridden, override_env, replay_count, replayed
from .watching import Stop, Watch

LINGER_S = 10.0  # how long the script may still run after it wrote its report
REPORT_ENV = "MMPACK_DOCTOR_REPORT"
STEPS_ENV = "MMPACK_DOCTOR_STEPS"
PROBES_ENV = "MMPACK_DOCTOR_PROBES"  # "0": the loop only (a rerun), no run of the loader after it
RANKS_ENV = "MMPACK_DOCTOR_RANKS"  # a torchrun job's folder: each rank writes rank-<RANK>.json there


def run(command: list[str], *, steps: int | None, deadline_s: float | None = None, confirm: int = 0,
        replay: int | None = None) -> Report:
    """`command` (`python [OPTIONS] script.py ARGS`, `python -m MODULE ARGS`) in a child process
    with its loaders watched; `deadline_s`: the longest the loop may go without a batch or an
    optimizer step, and any probe or trial without an answer (`deadline`). Then, where the loop
    waited, the first `confirm` fixes that are loader arguments each applied in a run of its own,
    and with `replay`, a run with the loader's first `replay` batches served again and again
    (`rerun`)."""
    if torchrun_command(command):
        return _job(command, steps, deadline_s)
    r = _once(command, steps, deadline_s, {})
    if r.loop is None and replay and not r.exit_code:
        r.note = "; ".join(n for n in (r.note, "--replay needs a DataLoader or Loader in the loop: none was iterated")
                           if n)
    if r.loop is None or r.exit_code:
        return r
    if replay:
        again = _once(command, steps, deadline_s, {REPLAY_ENV: str(replay), PROBES_ENV: "0"})
        r.replay = replayed(r, again, replay)
    for fix in [f for f in r.fixes or [] if f.args][:confirm]:
        print(f"bench doctor: confirming {fix.fix} in a run of its own", file=sys.stderr)
        fix.confirmed = confirmed(r, _once(command, steps, deadline_s, {**override_env(r, fix.args), PROBES_ENV: "0"}))
    return r


def _job(command: list[str], steps: int | None, deadline_s: float | None) -> Report:
    """A torchrun job, every rank watched (`ranks`): the straggler's report with the job's figures."""
    with tempfile.TemporaryDirectory(prefix="mmpack-doctor-") as tmp:
        started = time.perf_counter()
        proc = subprocess.Popen(torchrun_command(command), env=_env(steps, deadline_s, {RANKS_ENV: tmp}),
                                start_new_session=True)
        with _group_ends_with_us(proc):
            code, _ = _wait(proc, Path(tmp) / "never")
        straggler, ranks = ranks_job(read_all(Path(tmp)))
    if straggler is None:
        return Report(wall_s=time.perf_counter() - started, exit_code=code, command=command,
                      verdict=f"the job ended (exit {code}) before any rank made a report")
    straggler.command, straggler.exit_code, straggler.python = command, code, sys.executable
    if ranks is not None:
        straggler.ranks, straggler.verdict = ranks, job_verdict(ranks, straggler)
    return straggler


def _once(command: list[str], steps: int | None, deadline_s: float | None, extra: dict) -> Report:
    given, options, target = python_command(command)
    python, note = interpreter(given)
    if note:
        print(f"bench doctor: {note}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="mmpack-doctor-") as tmp:
        out = Path(tmp) / "report.json"
        started = time.perf_counter()
        proc = subprocess.Popen([python, *options, "-c", "import sys; from bench.doctor import child_main; "
                                 "child_main(sys.argv[1:])", *target], env=_env(steps, deadline_s, {REPORT_ENV: str(out), **extra}),
                                start_new_session=True)
        with _group_ends_with_us(proc):
            code, lingered = _wait(proc, out)
        if not out.exists():
            return Report(wall_s=time.perf_counter() - started, exit_code=code,
                          verdict=f"the script ended (exit {code}) before a report could be made")
        r = read_report(out)
    r.command, r.exit_code, r.python = command, code, python
    r.note = "; ".join(n for n in (note, lingered) if n) or None
    return r


def _env(steps: int | None, deadline_s: float | None, extra: dict) -> dict:
    """The child's environment: this one, with the step limit, the deadline and `extra`."""
    env = {**os.environ, STEPS_ENV: str(steps or ""), **extra}
    if deadline_s is not None:
        env[DEADLINE_ENV] = str(deadline_s)
    return env


def _wait(proc: subprocess.Popen, report: Path) -> tuple[int, str | None]:
    """The script's exit status, once it exits; a script still running LINGER_S after it wrote
    its report (a child process or thread it never ends holds its exit) is stopped, and said."""
    written = None
    while True:
        try:
            return proc.wait(timeout=0.2), None
        except subprocess.TimeoutExpired:
            pass
        if written is None and report.exists():
            written = time.monotonic()
        if written is not None and time.monotonic() - written > LINGER_S:
            _end_group(proc)
            return proc.wait(), (f"the script had not exited {LINGER_S:g} s after its report (a process or thread "
                                 "it started still ran): the doctor stopped it")


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the script's process group, SIGKILL to what is left of it a moment later."""
    for sig, wait_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _group_alive(proc.pid):
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


@contextmanager
def _group_ends_with_us(proc: subprocess.Popen):
    """The script runs in a process group of its own (its workers and children with it): a
    SIGTERM to the doctor ends that group before the doctor ends, and so does the doctor's own
    end; nothing of the script outlives it. A first Ctrl-C (SIGINT) goes on to the script, which
    stops where it is and leaves its partial report; a second ends the group as SIGTERM does."""
    interrupted = []

    def stop(signum, frame):
        if signum == signal.SIGINT and not interrupted:
            interrupted.append(signum)
            try:
                os.killpg(proc.pid, signal.SIGINT)
            except (ProcessLookupError, PermissionError):
                pass
            return
        _end_group(proc)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    saved = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        if _group_alive(proc.pid):  # what the script left running (a daemon it started), or a failure here
            _end_group(proc)
        proc.wait()


class _Interrupt:
    """The script's Ctrl-C (the doctor passes the first on), made sure to stop its loop: the
    handler is installed whatever the child inherited (a process started with SIGINT ignored
    keeps it ignored), and an interrupt lost on its way (raised inside a finalizer, which Python
    only prints) is raised again at the loop's next batch or optimizer step, in its thread."""

    def __init__(self):
        self.received = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        self.received = True
        raise KeyboardInterrupt

    def again(self) -> None:
        if self.received and threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt


def child_main(argv: list[str]) -> None:
    """In the child: run the script (`SCRIPT ARGS`, `-m MODULE ARGS` or `-c CODE ARGS`) as
    __main__, as `python` would, with its loaders watched, then write the report."""
    steps = int(os.environ[STEPS_ENV]) if os.environ.get(STEPS_ENV) else None
    w = Watch(steps, replay=replay_count())
    rank = os.environ.get(RANKS_ENV)  # one rank of a torchrun job: its own report, its loop only
    report = Path(rank) / f"rank-{os.environ.get('RANK', '0')}.json" if rank else Path(os.environ[REPORT_ENV])

    def stalled(limit: float) -> None:  # in the watchdog's thread, while the loop is stuck
        if w.stopped:  # at the step limit: the loop's iterators end (a stuck worker's join has its own timeout)
            return
        w.error = (f"no batch and no optimizer step for {limit:g} s (a DataLoader worker stuck on one item, a "
                   "deadlock?): the doctor stopped the script (--deadline)")
        write_report(w.diagnose(probes=False), report)
        os._exit(STALLED_EXIT)  # the doctor ends the rest of the script's process group
    dog = Watchdog(stalled)
    interrupt = _Interrupt()

    def progress() -> None:
        dog.progress()
        interrupt.again()
    w.progress = progress
    status, stopped = 0, False
    try:
        classes = loader_classes()  # torch's import: a Ctrl-C now stops a script that never began
    except KeyboardInterrupt:
        print("bench doctor: interrupted before the script started: nothing to report", file=sys.stderr)
        os._exit(130)
    with patched(w, classes), overridden(classes):
        try:
            _run_main(argv)
        except Stop:
            stopped = True
        except SystemExit as exc:
            if exc.code not in (None, 0):
                w.error = f"exit {exc.code}"
                status = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # noqa: BLE001 - the script's failure is part of the report
            w.error = (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)[:300]
            status = 1
            if not isinstance(exc, KeyboardInterrupt):  # its file and line, as python shows them
                _print_scripts_traceback(exc)
    dog.stop.set()
    w.progress = lambda: None
    write_report(w.diagnose(ceiling=not rank, probes=os.environ.get(PROBES_ENV) != "0"), report)
    if stopped:
        # stopped at the step limit mid-loop, the script ends here, as a signal would end it: its
        # interpreter is not torn down around the loop's half-done state, where it aborted now and
        # then after the report was written ("terminate called without an active exception", exit
        # 134; twice in the suite, never on demand); the doctor ends what it left in its group
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if status:  # the script's own status, as `python script.py` gives it (a CI step must see the failure)
        sys.exit(status)


def _print_scripts_traceback(exc: BaseException) -> None:
    """The script's traceback as python would print it, the doctor's own frames left out."""
    here = os.path.dirname(os.path.abspath(__file__))
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(here):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def _run_main(argv: list[str]) -> None:
    """`argv` run as `python ARGV` runs it: sys.argv, sys.path[0] and the __main__ module as that
    interpreter sets them. The script's module stays __main__ after it ends, as it does in python:
    the loader measured alone afterwards pickles the script's classes for its workers (spawn,
    forkserver) by their names in __main__."""
    if argv[0] == "-m":  # sys.path[0] is the working directory, argv[0] the module's file
        _path_first(os.getcwd())
        spec = importlib.util.find_spec(argv[1])
        if spec is not None and spec.submodule_search_locations is not None:  # a package: its __main__
            spec = importlib.util.find_spec(f"{argv[1]}.__main__")
        if spec is None or spec.loader is None or spec.origin is None:
            raise ImportError(f"No module named {argv[1]}")
        sys.argv = [spec.origin, *argv[2:]]
        _exec_as_main(spec.loader.get_code(spec.name), spec.origin, spec)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        _exec_as_main(compile(argv[1], "<string>", "exec"), None, None)
    else:  # not the working directory: the script's own folder comes first on the path
        sys.argv = argv
        _path_first(str(Path(argv[0]).resolve().parent))
        if os.path.isfile(argv[0]) and not zipfile.is_zipfile(argv[0]):
            path = os.path.abspath(argv[0])  # __main__.__file__ is absolute from Python 3.9 on
            with io.open_code(path) as f:
                _exec_as_main(compile(f.read(), path, "exec"), path, None)
        else:  # a folder or zip with a __main__.py
            runpy.run_path(argv[0], run_name="__main__")


def _exec_as_main(code, file: str | None, spec) -> None:
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=file, __spec__=spec, __loader__=spec.loader if spec else None, __cached__=None,
                         __package__=spec.parent if spec else None, __builtins__=builtins)
    if file is None:
        del main.__file__
    sys.modules["__main__"] = main
    exec(code, main.__dict__)  # noqa: S102 - the user's own script, as python runs it


def _path_first(folder: str) -> None:
    """sys.path[0] as python sets it for what it runs: the child's own, from `-c`, is "" (the
    working directory); in safe-path mode (-P, -I) there is none, and none is added."""
    if sys.path[:1] == [""]:
        sys.path[0] = folder
