"""Python run from a clone's root after ``pip install .`` (not ``-e``): the clone's
``fastckpt/`` comes first on ``sys.path`` and has no built native module, while the installed
package has one. fastckpt loads the installed ``_C`` (when it provides what the tree's stub
declares) or says what happened and what to do.

The clone here is a copy of the package's sources without ``_C``; its child processes run
with ``-S`` (no ``.pth`` files, so the development install's import redirect is off) and
site-packages on ``PYTHONPATH``, where the installed distribution's ``_C`` and its record
are: the layout of a non-editable install. tests/test_install.py checks the same against a
real ``pip install .`` in a fresh environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import fastckpt

PACKAGE = Path(fastckpt.__file__).resolve().parent
# Every site directory this interpreter uses (a venv made with --system-site-packages finds
# torch in the system's): the children run with -S, so no .pth file (and no editable
# install's redirect) is read, and these are their whole path.
SITE = os.pathsep.join(
    dict.fromkeys(
        [sysconfig.get_paths()["purelib"], *(p for p in sys.path if p.endswith("site-packages"))]
    )
)


def _installed_extension() -> str | None:
    return fastckpt._installed_extension()


pytestmark = pytest.mark.skipif(
    _installed_extension() is None, reason="no installed fastckpt-io lists a native module"
)


def source_copy(destination: Path) -> Path:
    """The package's Python sources and stub, as a clone holds them before any build."""
    for source in PACKAGE.rglob("*"):
        if source.suffix in (".py", ".pyi", ".typed") and "__pycache__" not in source.parts:
            target = destination / "fastckpt" / source.relative_to(PACKAGE)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    assert not list((destination / "fastckpt").glob("_C.*.so"))
    return destination


def run_from(clone: Path, *args: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHONPATH": SITE, "FASTCKPT_NO_PROGRESS": "1"}
    return subprocess.run(
        [sys.executable, "-S", *args],
        cwd=clone,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_installed_native_module_serves_a_shadowing_source_tree(tmp_path: Path) -> None:
    clone = source_copy(tmp_path / "clone")
    probe = (
        "import torch, fastckpt\n"
        "from fastckpt import _C\n"
        "print(fastckpt.__file__)\n"
        "print(_C.__file__)\n"
        "fastckpt.save({'epoch': 3, 'w': torch.arange(4.0)}, 'ckpt.safetensors')\n"
        "print(fastckpt.load('ckpt.safetensors')['w'].tolist())\n"
    )
    done = run_from(clone, "-c", probe)
    assert done.returncode == 0, done.stderr
    package_file, native_file, values = done.stdout.splitlines()
    assert Path(package_file).resolve().is_relative_to(clone.resolve())
    assert Path(native_file).resolve() == Path(_installed_extension()).resolve()
    assert values == "[0.0, 1.0, 2.0, 3.0]"

    verified = run_from(clone, "-m", "fastckpt", "verify", "ckpt.safetensors")
    assert verified.returncode == 0, verified.stderr
    assert "OK" in verified.stdout


def test_a_stale_installed_module_is_named_with_what_to_do(tmp_path: Path) -> None:
    clone = source_copy(tmp_path / "clone")
    stub = clone / "fastckpt" / "_C.pyi"
    stub.write_text(stub.read_text() + "\ndef added_since_the_install() -> None: ...\n")
    done = run_from(clone, "-c", "from fastckpt import _C")
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: fastckpt was imported from"), message
    assert str(clone / "fastckpt") in message
    assert _installed_extension() in message
    assert "added_since_the_install" in message
    assert "run Python outside" in message and "pip install -e ." in message
