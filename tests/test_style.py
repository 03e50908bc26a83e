"""The code stays formatted, lint-clean and type-checked: ruff and mypy for Python,
clang-format for C++."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(tool: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    exe = shutil.which(tool)
    if exe is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[test]' installs it)")
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_ruff_lint():
    proc = _run("ruff", "check", "--no-cache", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format():
    proc = _run("ruff", "format", "--no-cache", "--check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_clang_format():
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.[ch]*"))
    assert sources
    proc = _run("clang-format", "--dry-run", "--Werror", *sources)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy():
    # [tool.mypy] in pyproject.toml names the package and the options. The cache in
    # .mypy_cache makes later runs take seconds; a cold run takes a minute or two.
    proc = _run("mypy", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
