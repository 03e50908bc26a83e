"""Install advice names this project's distribution, ``fastckpt-io``: ``fastckpt`` on PyPI is
an unrelated project, so a message or page saying ``pip install 'fastckpt[...]'`` would
install it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.test_install import readme_bash_block

ROOT = Path(__file__).resolve().parent.parent


def test_compress_without_zstandard_names_the_distribution(tmp_path: Path) -> None:
    # A child process where zstandard cannot be imported, as on a machine without it.
    code = (
        "import sys; sys.modules['zstandard'] = None\n"
        "import torch, fastckpt\n"
        "try:\n"
        "    fastckpt.save({'w': torch.randn(100000)}, sys.argv[1], compress=True)\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "c.safetensors")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "pip install 'fastckpt-io[compress]'" in out.stdout, out.stdout
    assert "fastckpt[" not in out.stdout


def test_no_install_advice_names_the_other_project() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.toml", "*.cfg", "*.pyi"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    offenders = [
        name
        for name in listed
        if (ROOT / name).is_file()
        and name != "tests/test_distribution_name.py"
        and "fastckpt[" in (ROOT / name).read_text(encoding="utf-8")
    ]
    assert offenders == []


def test_the_readme_install_section_has_the_compress_line() -> None:
    assert 'pip install ".[compress]"' in readme_bash_block("Install")
