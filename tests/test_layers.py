"""The package's shape: layers that import only downward, no cycles, light imports."""

from __future__ import annotations

import ast
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


def _public_names() -> dict[str, str]:
    """The package root's lazy names -> the module each is loaded from."""
    import fastckpt

    return {name: module for name, (module, _) in fastckpt._PUBLIC.items()}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_modules() -> dict[str, ast.Module]:
    """Every module of the package (but the root, whose lazy names these are) -> its AST."""
    modules = {}
    for path in sorted((ROOT / "fastckpt").rglob("*.py")):
        name = _module_name(path)
        if name != "fastckpt":
            modules[name] = ast.parse(path.read_text(), str(path))
    return modules


def lazy_imports(tree: ast.Module, public: dict[str, str]) -> set[str]:
    """The modules a module reaches through the package root's lazy names: ``import
    fastckpt`` then ``fastckpt.save`` imports ``fastckpt.api`` as surely as ``from
    fastckpt.api import save`` does, but no import graph sees it."""
    reached = set()
    binds_root = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            binds_root |= any(
                alias.name.split(".")[0] == "fastckpt" and alias.asname is None
                for alias in node.names
            )
        elif isinstance(node, ast.ImportFrom) and node.module == "fastckpt" and not node.level:
            reached |= {public[a.name] for a in node.names if a.name in public}
    if binds_root:
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "fastckpt"
                and node.attr in public
            ):
                reached.add(public[node.attr])
    return reached


def import_graph():
    """grimp's graph of the package, plus an edge for every use of a lazy name of the root."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("fastckpt", exclude_type_checking_imports=True)
    public = _public_names()
    for module, tree in _package_modules().items():
        for target in lazy_imports(tree, public):
            graph.add_import(importer=module, imported=target)
    return graph


def find_cycles(graph) -> list[tuple[str, ...]]:
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if imported != module and graph.chain_exists(imported, module):
                cycles.append(graph.find_shortest_chain(imported, module) + (imported,))
    return cycles


def test_no_import_cycles():
    """No cycle among fastckpt's modules, function-local imports and the root's lazy names
    (``fastckpt.save`` from inside the package) included."""
    cycles = find_cycles(import_graph())
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_lazy_names_count_as_imports():
    """The check sees a call through the root: a module below api that calls
    ``fastckpt.save`` closes the cycle api -> it -> api."""
    public = _public_names()
    source = "import fastckpt\n\ndef f(x, path):\n    fastckpt.save(x, path)\n"
    assert lazy_imports(ast.parse(source), public) == {"fastckpt.api"}
    assert lazy_imports(ast.parse("from fastckpt import open, format"), public) == {"fastckpt.api"}
    assert lazy_imports(ast.parse("import fastckpt\nfastckpt.format.x"), public) == set()
    graph = import_graph()
    graph.add_module("fastckpt.integrations.synthetic")
    graph.add_import(importer="fastckpt.api", imported="fastckpt.integrations.synthetic")
    for target in lazy_imports(ast.parse(source), public):
        graph.add_import(importer="fastckpt.integrations.synthetic", imported=target)
    assert any("fastckpt.integrations.synthetic" in c for c in find_cycles(graph))


def test_nothing_inside_calls_the_package_root():
    """No module of the package imports the root to reach a public name (``import
    fastckpt`` / ``from fastckpt import save``): it calls the layer below directly."""
    public = _public_names()
    offenders = sorted(
        module
        for module, tree in _package_modules().items()
        if lazy_imports(tree, public) or _imports_root(tree)
    )
    assert offenders == [], offenders


def _imports_root(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.Import) and any(a.name == "fastckpt" for a in node.names)
        for node in ast.walk(tree)
    )


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


def test_one_header_reader():
    """Only the format layer decodes a header's length prefix and JSON: every reader (the
    checkpoint core, ``fastckpt inspect``, DCP) goes through ``format.read_header_from``."""
    decoders = {"parse_header", "parse_header_length"}
    offenders = sorted(
        f"{module}:{node.lineno}"
        for module, tree in _package_modules().items()
        if not module.startswith("fastckpt.format")
        for node in ast.walk(tree)
        if (isinstance(node, ast.Name) and node.id in decoders)
        or (isinstance(node, ast.Attribute) and node.attr in decoders)
        or (isinstance(node, ast.alias) and node.name in decoders)
    )
    assert offenders == [], offenders


def test_inspect_reads_headers_without_torch(tmp_path):
    """``fastckpt inspect`` of a file works where torch is not installed."""
    from fastckpt.format import encode_header, plan_layout

    path = tmp_path / "tiny.safetensors"
    path.write_bytes(encode_header(plan_layout([("w", "F32", (2,))]), {}) + bytes(8))
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "from fastckpt.cli import main\n"
        "sys.argv = ['fastckpt', 'inspect', '--json', sys.argv[1]]\n"
        "sys.exit(main())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert '"name": "w"' in done.stdout
