"""The training command as python reads its own: the interpreter, its options, and what it runs
(a script, `-m MODULE` or `-c CODE`); and which Python the child runs it with."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

USAGE = "give the training command after --, e.g. -- python train.py ARGS (or -- python -m pkg.train ARGS)"
# python's own options: those that take a value (-W default, -Wdefault), those that end the options
_OPTION_VALUE, _OPTION_TARGET = "WX", "mc"
LAUNCHERS = ("torchrun", "accelerate", "deepspeed", "mpirun", "srun", "lightning", "composer")


def python_command(command: list[str]) -> tuple[str, list[str], list[str]]:
    """(interpreter, its options, what it runs) of `python [OPTIONS] SCRIPT|-m MODULE|-c CODE ARGS`
    (`SCRIPT.py ARGS` alone: this Python). The options (-u, -O, -W ..., -X ...) go to the child's
    interpreter; what it runs is `SCRIPT ARGS`, `-m MODULE ARGS` or `-c CODE ARGS`."""
    if not command:
        raise SystemExit(f"bench doctor: {USAGE}")
    if command[0].endswith(".py"):
        return sys.executable, [], command
    name = Path(command[0]).name
    if name in LAUNCHERS:
        raise SystemExit(f"bench doctor: {name} starts several processes, and the doctor watches every rank of a "
                         "torchrun job only: run it with torchrun, or one rank's script, e.g. -- python train.py ARGS")
    version = name[len("python"):]
    if name != Path(sys.executable).name and not (name.startswith("python") and version.replace(".", "").isdigit()
                                                   or name == "python"):
        raise SystemExit(f"bench doctor: {command[0]} is not a Python interpreter: {USAGE}")
    options, rest = _options(command[1:])
    if not rest or rest[0] == "-":
        raise SystemExit(f"bench doctor: a script from standard input cannot be watched: {USAGE}")
    return command[0], options, rest


def _options(rest: list[str]) -> tuple[list[str], list[str]]:
    """python's options taken off the front of `rest`: (the options, what it runs). -m and -c end
    them, with what follows theirs."""
    options, rest = [], list(rest)
    while rest and rest[0].startswith("-") and rest[0] != "-":
        arg = rest.pop(0)
        if arg.startswith("--"):  # --check-hash-based-pycs MODE; the others take no value
            options += [arg, rest.pop(0)] if arg == "--check-hash-based-pycs" and rest else [arg]
            continue
        for i, flag in enumerate(arg[1:], 1):
            if flag in _OPTION_VALUE + _OPTION_TARGET:
                if i > 1:  # the flags before it: -uW ignore is -u -W ignore
                    options.append(arg[:i])
                value = arg[i + 1:] or (rest.pop(0) if rest else None)
                if value is None:
                    raise SystemExit(f"bench doctor: python's -{flag} needs a value: {USAGE}")
                if flag in _OPTION_TARGET:
                    return options, [f"-{flag}", value, *rest]
                options += [f"-{flag}", value]
                break
        else:
            options.append(arg)
    return options, rest


def interpreter(given: str) -> tuple[str, str | None]:
    """(the Python to run the script with, a note): the one given where it can import this
    doctor and torch (the script's own environment), else this one, said."""
    found = shutil.which(given)
    if found is None:
        raise SystemExit(f"bench doctor: {given}: no such interpreter")
    if os.path.abspath(found) == os.path.abspath(sys.executable):
        return sys.executable, None
    probe = subprocess.run([found, "-c", "import sys, importlib.util as u; "  # found, not imported: torch takes seconds
                            "sys.exit(not (u.find_spec('torch') and u.find_spec('bench.doctor')))"], capture_output=True)
    if probe.returncode == 0:
        return found, None
    return sys.executable, (f"{found} cannot import mmpack's bench and torch (pip install them there): "
                            f"the script runs with {sys.executable}")
