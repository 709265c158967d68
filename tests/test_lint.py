"""The lint configuration in pyproject.toml (ruff: unused and undefined names, syntax errors,
bugbear's likely bugs) holds for the whole tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff")
    if ruff is None:
        try:
            import ruff as _  # noqa: F401
        except ImportError:
            pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
        command = [sys.executable, "-m", "ruff"]
    else:
        command = [ruff]
    out = subprocess.run([*command, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]


def test_no_python_newer_than_310_is_needed():
    """Every module runs on Python 3.10, the oldest that pyproject.toml admits: vermin knows which
    release each standard-library name came in (hashlib.file_digest, 3.11, once broke every
    checksum there). `long` is Python 2's type to vermin, our variable here."""
    pytest.importorskip("vermin", reason="vermin is not installed (pip install -e '.[test]' installs it)")
    vermin = [sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())"]
    out = subprocess.run([*vermin, "-t=3.10-", "--no-tips", "--violations", "--exclude", "long", "packer", "loaders",
                          "bench", "scripts", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]
