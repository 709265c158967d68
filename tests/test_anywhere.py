"""The tests do not depend on how a distribution packages Python: the tests that once needed the
stdlib's own test suite (a vocabulary of more than 65,535 words, the text samples) pass with the
parts Debian and Ubuntu ship apart hidden (`test`, `idlelib`, `tkinter`, `distutils`,
`lib2to3`, `ensurepip`: an empty tmpfs over each, in a mount namespace of its own). The whole
suite was run that way too: `unshare -m tests/tools/debian_stdlib.sh python -m pytest -q`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _can_unshare(),
                    reason="needs root and mount namespaces to hide parts of the stdlib")
def test_the_vocabulary_and_text_tests_pass_without_the_stdlib_test_suite():
    cmd = ["unshare", "-m", "--propagation", "private", str(ROOT / "tests" / "tools" / "debian_stdlib.sh"),
           sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-k",  # a few tests: no workers
           "large_vocabulary or text_tokens_equal or append_text", "tests/builder/test_build_e2e.py", "tests/builder/test_append.py"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHON": sys.executable})
    assert "hidden: ['test', 'idlelib', 'tkinter', 'lib2to3', 'ensurepip']" in out.stderr, out.stderr[-2000:]
    assert out.returncode == 0 and " passed" in out.stdout and "failed" not in out.stdout, out.stdout[-3000:]
