"""The README's install lines work on a fresh machine: they run, verbatim, in a new virtual
environment (no system site-packages) over a copy of the repository's tracked files, and what
they install is the fastckpt of that copy, with each extra's packages importable.

The README's demo line installs the bench extra and runs ``fastckpt bench``; the test runs its
install part as written and the bench on a small checkpoint (the README's 1 GiB run measures
the disk, which is the benchmarks' job, not a test's).

Against that non-editable install, from the clone's root (where the clone's ``fastckpt/``, which
has no built native module, comes first on ``sys.path``) and from outside it, the README's
Quickstart and every example run, and ``python -m fastckpt verify`` checks what they wrote.

This is the suite's slowest test (about five minutes on 2 cores: torch's wheel, five wheel
builds of the native module, and the examples twice); it needs the package index that ``pip install
torch==2.13.0`` uses everywhere else.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.test_docs import blocks

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def readme_block(after_heading: str, language: str) -> str:
    """The code of the first block in ``language`` under a README heading."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {after_heading}\n")
    section_line = text.count("\n", 0, start) + 2
    block = next(b for b in blocks(README) if b.language == language and b.line > section_line)
    return block.code


def readme_bash_block(after_heading: str) -> list[str]:
    """The command lines (comments dropped) of the first ```bash block under a README heading."""
    code = readme_block(after_heading, "bash")
    commands = [line.split("#", 1)[0].strip() for line in code.splitlines()]
    return [command for command in commands if command]


def tracked_copy(destination: Path) -> Path:
    """A copy of the files git tracks: what a fresh clone holds, without build outputs."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.split(b"\0")
    for name in filter(None, (entry.decode() for entry in listed)):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def run_in_env(command: str, env_dir: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """One shell line, with the environment's bin/ first on PATH (so ``pip`` is its pip)."""
    environ = {**os.environ, "PATH": f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    environ.pop("PYTHONPATH", None)
    environ["VIRTUAL_ENV"] = str(env_dir)
    environ["FASTCKPT_NO_PROGRESS"] = "1"
    done = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=environ, capture_output=True, text=True
    )
    assert done.returncode == 0, f"{command!r} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return done


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to list the tracked files")
def test_the_readme_install_lines_work_in_a_fresh_environment(tmp_path: Path) -> None:
    install = readme_bash_block("Install")
    demo = readme_bash_block("Two commands")[0]
    assert any(command.endswith("pip install .") for command in install), install
    clone = tracked_copy(tmp_path / "clone")
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)

    for command in install:
        run_in_env(command, env_dir, clone)
    demo_install, bench = demo.rsplit(" && fastckpt bench", 1)
    run_in_env(demo_install, env_dir, clone)

    python = env_dir / "bin" / "python"
    probe = (
        "import fastckpt, fastckpt.lightning, s3fs, lightning, torch\n"
        "print(fastckpt.__file__)\n"
        "fastckpt.save({'w': torch.arange(6.0)}, 'probe.safetensors')\n"
        "assert fastckpt.load('probe.safetensors')['w'].tolist() == [0, 1, 2, 3, 4, 5]\n"
    )
    imported_from = run_in_env(f"{python} -c {shlex.quote(probe)}", env_dir, tmp_path)
    assert imported_from.stdout.strip().startswith(str(env_dir)), imported_from.stdout

    small_bench = "fastckpt bench" + re.sub(r"--checkpoint \S+", "--checkpoint 8M", bench)
    report = run_in_env(small_bench, env_dir, tmp_path).stdout
    assert re.search(r"^fastckpt\s+\d", report, re.MULTILINE), report
    assert Path(sys.executable).resolve() != python.resolve()

    outside = tmp_path / "outside"
    outside.mkdir()
    # From the clone's root, whose fastckpt/ (no native module built there) comes first on
    # sys.path, the Quickstart; from outside, the Quickstart and every example (the examples
    # import nothing that depends on where they run from).
    run_the_quickstart(python, env_dir, clone)
    run_the_quickstart(python, env_dir, outside)
    run_the_examples(python, env_dir, outside, clone / "examples")


def run_the_quickstart(python: Path, env_dir: Path, cwd: Path) -> None:
    """The README's Quickstart (fed to ``python -``, so ``cwd`` leads ``sys.path`` as in a
    terminal), then ``python -m fastckpt verify`` on what it wrote."""
    # the Quickstart writes into a temporary run directory: one added line says where
    quickstart = readme_block("Quickstart", "python") + '\nprint(run / "ckpt.safetensors")'
    done = run_in_env(f"{python} - <<'QUICKSTART'\n{quickstart}\nQUICKSTART", env_dir, cwd)
    written = done.stdout.strip().splitlines()[-1]
    assert list(cwd.iterdir()) == [] or cwd.name == "clone", list(cwd.iterdir())
    verified = run_in_env(f"{python} -m fastckpt verify {shlex.quote(written)}", env_dir, cwd)
    assert "OK" in verified.stdout, verified.stdout


def run_the_examples(python: Path, env_dir: Path, cwd: Path, examples: Path) -> None:
    """Every example, each into a folder of its own."""
    for script in sorted(examples.glob("*.py")):
        folder = cwd / f"run-{script.stem}"
        folder.mkdir()
        command = f"{python} {shlex.quote(str(script))} {shlex.quote(str(folder))}"
        out = run_in_env(command, env_dir, cwd).stdout
        if script.name == "train_with_manager.py":  # its children import fastckpt too
            assert "newest committed: True" in out and "finished: step 24" in out, out
