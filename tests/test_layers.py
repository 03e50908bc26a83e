"""The package's shape: layers that import only downward, no cycles, light imports."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold():
    """setup.cfg's import-linter contracts (layers, a pure format) are kept."""
    lint_imports = shutil.which("lint-imports")
    if lint_imports is None:
        pytest.fail("lint-imports is not installed: pip install -e '.[test]'")
    done = subprocess.run(
        [lint_imports, "--config", str(ROOT / "setup.cfg"), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_no_import_cycles():
    """No cycle among fastckpt's modules, function-local imports included."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("fastckpt", exclude_type_checking_imports=True)
    modules = sorted(graph.modules)
    cycles = []
    for module in modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if imported != module and graph.chain_exists(imported, module):
                cycles.append(graph.find_shortest_chain(imported, module) + (imported,))
    assert not cycles, f"import cycles: {cycles[:5]}"


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running ``code``."""
    probe = f"{code}\nimport sys\nprint('MODULES', *sorted(sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.splitlines()[-1].split()[1:])


def test_format_is_pure():
    loaded = _modules_after("import fastckpt.format")
    assert not {"torch", "numpy", "fastckpt._C"} & loaded


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"], ["verify", "--help"]])
def test_command_line_help_loads_no_torch(argv):
    loaded = _modules_after(
        "import sys\n"
        f"sys.argv = ['fastckpt', *{argv!r}]\n"
        "from fastckpt.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass"
    )
    assert "torch" not in loaded and "fastckpt._C" not in loaded


def test_public_names_load_on_first_use():
    loaded = _modules_after("import fastckpt")
    assert "torch" not in loaded
    loaded = _modules_after("import fastckpt\nfastckpt.save")
    assert "torch" in loaded and "fastckpt.checkpoint.save" in loaded


def test_every_public_name_resolves():
    import fastckpt

    for name in fastckpt.__all__:
        assert getattr(fastckpt, name) is not None, name
    with pytest.raises(AttributeError, match="no_such_name"):
        fastckpt.no_such_name  # noqa: B018


def test_typed_package_ships_its_marker():
    assert (ROOT / "fastckpt" / "py.typed").is_file()


def test_one_alignment_constant():
    """The alignment is written as a number once (format.schema); code elsewhere names it."""
    offenders = []
    for path in (ROOT / "fastckpt").rglob("*.py"):
        if path.name in ("schema.py", "synthetic.py"):  # synthetic.py: a model's hidden size
            continue
        with path.open("rb") as source:
            for token in tokenize.tokenize(source.readline):
                if token.type == tokenize.NUMBER and token.string in ("4096", "4095"):
                    offenders.append(
                        f"{path.relative_to(ROOT)}:{token.start[0]}: {token.line.strip()}"
                    )
    assert not offenders, offenders


def test_torch_is_optional():
    """Without torch: the DeepNVMe API works on numpy arrays; save says what to install."""
    code = """
import sys
sys.modules["torch"] = None  # as if torch were not installed
import numpy as np
import fastckpt, fastckpt.aio, fastckpt.format
a = np.arange(1000, dtype=np.float32)
path = sys.argv[1]
h = fastckpt.aio.aio_handle()
h.sync_pwrite(a, path)
b = np.empty_like(a)
h.sync_pread(b, path)
assert (a == b).all()
try:
    fastckpt.save({}, path)
except ImportError as exc:
    print("IMPORT-ERROR", exc)
"""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        done = subprocess.run(
            [sys.executable, "-c", code, f"{d}/x.bin"], capture_output=True, text=True
        )
    assert done.returncode == 0, done.stderr
    assert "IMPORT-ERROR fastckpt.save needs PyTorch" in done.stdout
    assert "pip install torch" in done.stdout
