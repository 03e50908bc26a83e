"""fastckpt.bench: the harness's shared definitions and its place below the command line."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def _assignments(name: str) -> list[str]:
    """Every module of the package and benchmarks/ that assigns ``name`` at its top level."""
    found = []
    for path in sorted([*(ROOT / "fastckpt").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found.append(str(path.relative_to(ROOT)))
    return found


def test_memory_filesystems_has_one_definition():
    from fastckpt.bench import filesystems
    from fastckpt.io import page_cache

    assert _assignments("MEMORY_FILESYSTEMS") == ["fastckpt/io/page_cache.py"]
    assert filesystems.MEMORY_FILESYSTEMS is page_cache.MEMORY_FILESYSTEMS
    assert {"tmpfs", "ramfs"} <= page_cache.MEMORY_FILESYSTEMS


def test_mountinfo_is_parsed_in_one_place():
    """Only fastckpt.mounts reads the mount table."""
    readers = [
        str(path.relative_to(ROOT))
        for path in [*(ROOT / "fastckpt").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
        if "mountinfo" in path.read_text(encoding="utf-8")
    ]
    assert set(readers) <= {"fastckpt/mounts.py"}, readers


def test_on_memory_filesystem(tmp_path):
    from fastckpt.bench.filesystems import filesystem_of, on_memory_filesystem

    assert on_memory_filesystem("/proc/self") is False
    if Path("/dev/shm").is_dir():
        assert on_memory_filesystem("/dev/shm") == (filesystem_of("/dev/shm")[0] == "tmpfs")


def test_harness_imports_neither_the_cli_nor_torch():
    """Every harness module imports without the command line and without torch (so
    ``fastckpt --help`` and a benchmark's driver stay light)."""
    modules = [p.stem for p in (ROOT / "fastckpt" / "bench").glob("*.py") if p.stem != "__init__"]
    code = (
        "import sys\n"
        f"for m in {modules!r}:\n"
        "    __import__('fastckpt.bench.' + m)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('fastckpt.cli')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_peers_call_the_checkpoint_layer_not_the_package_root(tmp_path):
    """The fastckpt savers and loaders are the checkpoint layer's own functions."""
    import torch

    from fastckpt.bench.peers import LOADERS, SAVERS

    source = (ROOT / "fastckpt" / "bench" / "peers.py").read_text(encoding="utf-8")
    assert "from fastckpt import" not in source and "import fastckpt\n" not in source
    path = str(tmp_path / "w.safetensors")
    SAVERS["fastckpt"].setup({"w": torch.arange(4.0)}, path)()
    assert LOADERS["fastckpt"].setup(path, "cpu")()["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert LOADERS["fastckpt-mmap"].setup(path, "cpu")()["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_anonymous_peak_sees_memory_held_inside_the_block_and_not_a_mapped_file(tmp_path):
    """In a process of its own (other tests' threads free memory meanwhile): 96 MiB held
    in the block counts, 96 MiB of a file mapped and read does not."""
    script = f"""
import mmap, time
from fastckpt.bench.measure import AnonymousPeak
with open({str(tmp_path / "f")!r}, "wb") as f:
    f.truncate(96 << 20)
with open({str(tmp_path / "f")!r}, "rb") as f, AnonymousPeak(interval=0.001) as mapped:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    assert sum(m[i] for i in range(0, 96 << 20, 4096)) == 0
    m.close()
with AnonymousPeak(interval=0.001) as held:
    block = b"x" * (96 << 20)
    time.sleep(0.05)
print(held.extra >> 20, mapped.extra >> 20)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    held, mapped = int(out[0]), int(out[1])
    assert held >= 90 and mapped < 16
