"""The README and the manual in docs/ stay true: their Python runs, their links resolve, and
the header's JSON Schema in docs/ agrees with the format code.

Every ```python block of a Markdown file runs, in order, in one namespace per file (so a
block can use what an earlier one defined) and in one fresh temporary working directory
per file (so it can open what an earlier one saved). A block that cannot run here is
preceded by ``<!-- not-run: REASON -->`` on the line before its fence; the reason is
required.
"""

from __future__ import annotations

import json
import re
import struct
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from fastckpt.format import compressed, references, schema

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
SCHEMA_FILE = DOCS / "header.schema.json"

NOT_RUN = re.compile(r"^\s*<!--\s*not-run\s*:?(?P<reason>.*?)-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>```+|~~~+)\s*(?P<info>[^`\s]*)")
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]]*\]\((?P<target>[^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(?P<title>.+?)\s*#*\s*$")


@dataclass
class Block:
    """One fenced code block: its info string, the line of its opening fence (1-based), its
    text (dedented), and its not-run reason."""

    language: str
    line: int
    code: str
    not_run: str | None  # the reason, when marked not-run; "" when the marker has none


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file (see :func:`blocks_in`)."""
    return blocks_in(path.read_text(encoding="utf-8"))


def blocks_in(text: str) -> list[Block]:
    """Every fenced block of Markdown text, with the not-run marker that precedes it.

    Example:
        >>> text = "<!-- not-run: needs a GPU -->\\n```python\\nx = 1\\n```\\n"
        >>> [(b.language, b.line, b.code, b.not_run) for b in blocks_in(text)]
        [('python', 2, 'x = 1\\n', 'needs a GPU')]
    """
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        ticks, indent = opening["ticks"], len(opening["indent"])
        marker = NOT_RUN.match(lines[i - 1]) if i > 0 else None
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(ticks):
            line = lines[j]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            j += 1
        found.append(
            Block(
                language=opening["info"].lower(),
                line=i + 1,
                code=textwrap.dedent("\n".join(body) + "\n"),
                not_run=marker["reason"].strip() if marker else None,
            )
        )
        i = j + 1
    return found


def prose(path: Path) -> str:
    """The file's text without its fenced blocks and inline code, where links are not links."""
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^(\s*)(```+|~~~+).*?^\1\2\s*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(title: str) -> str:
    """A heading's anchor as GitHub makes it.

    Example:
        >>> slug("CUDA and GPUDirect Storage (GDS)"), slug("`fastckpt.aio`: the API")
        ('cuda-and-gpudirect-storage-gds', 'fastckptaio-the-api')
    """
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link's text only
    title = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return title.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    for line in prose(path).splitlines():
        heading = HEADING.match(line)
        if not heading:
            continue
        base = slug(heading["title"])
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_manual_exists():
    assert (DOCS / "index.md").is_file()
    assert len(MARKDOWN) > 5
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


@pytest.mark.parametrize("path", MARKDOWN, ids=_id)
def test_not_run_markers_give_a_reason_and_precede_python(path):
    for block in blocks(path):
        if block.not_run is not None:
            assert block.not_run, f"{_id(path)}:{block.line}: not-run marker without a reason"
            assert block.language == "python", (
                f"{_id(path)}:{block.line}: marker on a non-Python block"
            )
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if "not-run" in line:
            assert NOT_RUN.match(line), f"{_id(path)}:{number}: malformed marker {line!r}"


# Lightning warns about the tiny data sets the examples train on; the examples stay short.
@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")
@pytest.mark.filterwarnings("ignore:.*number of training batches.*")
@pytest.mark.filterwarnings("ignore:.*is smaller than the logging interval.*")
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
@pytest.mark.filterwarnings("ignore:.*Checkpoint directory .* exists and is not empty.*")
@pytest.mark.parametrize("path", MARKDOWN, ids=_id)
def test_python_blocks_run(path, tmp_path, monkeypatch):
    runnable = [b for b in blocks(path) if b.language == "python" and b.not_run is None]
    if not runnable:
        pytest.skip(f"{_id(path)} has no runnable Python block")
    monkeypatch.chdir(tmp_path)
    # The blocks run as a script would, as __main__, so that classes they define pickle.
    script = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", script)
    namespace = script.__dict__
    for block in runnable:
        code = compile(block.code, f"{path}:{block.line}", "exec")
        try:
            exec(code, namespace)
        except Exception as exc:
            raise AssertionError(f"{_id(path)}:{block.line}: the block failed: {exc!r}") from exc
    # async saves a block started are the block's business: none may be left failing
    import fastckpt

    fastckpt.wait_all()


def broken_links(path: Path) -> list[str]:
    """The relative links of a Markdown file whose file, or heading anchor, does not exist."""
    text = prose(path)
    targets = [m["target"] for m in LINK.finditer(text)] + [
        m["target"] for m in IMAGE.finditer(text)
    ]
    broken = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    return broken


@pytest.mark.parametrize("path", MARKDOWN, ids=_id)
def test_relative_links_resolve(path):
    broken = broken_links(path)
    assert not broken, f"{_id(path)}: " + "; ".join(broken)


def test_the_checks_catch_what_they_are_for(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n\n## Part two\n\n[ok](#part-two) [gone](missing.md) [bad](#part-three)\n"
        "[web](https://example.com) `[code](nowhere.md)`\n\n"
        "<!-- not-run: -->\n```python\nraise SystemExit\n```\n",
        encoding="utf-8",
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "#part-three: no heading with anchor #part-three",
    ]
    (marked,) = blocks(page)
    assert marked.not_run == ""  # a marker without a reason, which the marker test refuses


def test_every_docs_page_is_linked_from_the_index():
    index = prose(DOCS / "index.md")
    linked = {(DOCS / m["target"].partition("#")[0]).resolve() for m in LINK.finditer(index)}
    for page in DOCS.rglob("*.md"):
        if page.name != "index.md":
            assert page.resolve() in linked, f"docs/index.md does not link {_id(page)}"


# The header's JSON Schema (docs/header.schema.json) against the format code.


def _schema() -> dict:
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


def test_the_schema_in_the_format_page_is_the_schema_file():
    page = (DOCS / "format.md").read_text(encoding="utf-8")
    section = page.split("## JSON Schema of the header", 1)[1]
    embedded = next(b for b in blocks_in(section) if b.language == "json")
    assert json.loads(embedded.code) == _schema()


def test_schema_names_the_codes_dtypes_and_keys():
    doc = _schema()
    tensor = doc["$defs"]["tensor"]
    assert sorted(tensor["properties"]["dtype"]["enum"]) == sorted(
        schema.DTYPES | {schema.COMPRESSED_DTYPE}
    )
    assert tensor["required"] == ["dtype", "shape", "data_offsets"]
    assert tensor["additionalProperties"] is False
    assert doc["properties"] == {schema.METADATA_KEY: {"$ref": "#/$defs/metadata"}}
    keys = set(doc["$defs"]["metadata"]["properties"])
    ours = {
        schema.KEY_VERSION,
        schema.KEY_HEADER_CRC,
        schema.KEY_CRC32C,
        schema.KEY_PIECE_CRC32C,
        schema.KEY_ALIASES,
        schema.KEY_TREE,
        references.KEY_XXH3_128,
        references.KEY_REFERENCES,
        compressed.KEY_COMPRESSED,
    }
    assert {k for k in keys if k.startswith(schema.META_PREFIX)} == ours
    version = doc["$defs"]["metadata"]["properties"][schema.KEY_VERSION]
    assert tuple(version["enum"]) == schema.READABLE_VERSIONS
    extra = doc["x-fastckpt"]
    assert extra["header_limit_bytes"] == schema.HEADER_LIMIT
    assert extra["alignment_default"] == schema.DEFAULT_ALIGNMENT
    assert extra["piece_size_default"] == schema.DEFAULT_PIECE_SIZE
    assert extra["format_version"] == schema.FORMAT_VERSION


def test_the_test_extra_installs_jsonschema():
    """The schema tests skip without jsonschema, so CI's ``.[test]`` install must bring it."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    test_extra = pyproject["project"]["optional-dependencies"]["test"]
    names = {re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0] for requirement in test_extra}
    assert "jsonschema" in names


def _header_of(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_headers_fastckpt_writes_match_the_schema(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    torch = pytest.importorskip("torch")
    import fastckpt

    w = torch.ones(1100, 1000)
    fastckpt.save(
        {"model": {"w": w, "tied": w, "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": (1, 2)},
        tmp_path / "nested.safetensors",
        metadata={"note": "hi"},
    )
    fastckpt.save({"w": torch.arange(6, dtype=torch.int64)}, tmp_path / "flat.safetensors")
    fastckpt.save({"w": torch.ones(2)}, tmp_path / "plain.safetensors", checksum=False)
    fastckpt.save(
        {"w": torch.arange(6, dtype=torch.int64), "v": torch.ones(1)},
        tmp_path / "incremental.safetensors",
        base=tmp_path / "flat.safetensors",
    )
    validator = jsonschema.Draft202012Validator(_schema())
    for file in sorted(tmp_path.glob("*.safetensors")):
        validator.validate(_header_of(file))


@pytest.mark.parametrize(
    "header",
    [
        {"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
        {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}},
        {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
        {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}},
        {"__metadata__": {"step": 3}},
        {"__metadata__": {"fastckpt.header_crc": "XYZ"}},
    ],
)
def test_schema_refuses_what_the_reader_refuses(header):
    jsonschema = pytest.importorskip("jsonschema")
    from fastckpt.errors import HeaderError
    from fastckpt.format import parse_header

    assert not jsonschema.Draft202012Validator(_schema()).is_valid(header)
    raw = json.dumps(header).encode()
    with pytest.raises(HeaderError):
        parsed = parse_header(raw, 8 + len(raw) + 16)
        from fastckpt.format import split_metadata

        split_metadata(parsed.metadata)


def test_the_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    after = readme.split("Install and run the tests", 1)[1]
    command = next(b for b in blocks_in(after) if b.language == "bash").code.strip()
    assert "pytest" in command
    assert command in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()


def test_install_lines_install_from_the_clone():
    """The PyPI name ``fastckpt`` is another project: every install line uses the clone."""
    for path in MARKDOWN:
        for block in blocks(path):
            code = "\n".join(line.split("#")[0] for line in block.code.splitlines())
            for command in re.split(r"&&|;|\n", code):
                if "pip install" not in command:
                    continue
                for word in command.split()[2:]:
                    assert not re.match(r"""^['"]?fastckpt(\[|['"]|$)""", word), (
                        f"{_id(path)}:{block.line}: {command.strip()!r} installs the PyPI "
                        "package 'fastckpt', an unrelated project"
                    )


def test_the_distribution_name_is_free_and_said_in_the_readme():
    """PyPI's ``fastckpt`` is an unrelated project, so the distribution has its own name; the
    README says it, and the benchmarks look up the installed version under it."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    name = project["name"]
    assert name != "fastckpt"
    assert f"**`{name}`**" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert project["scripts"]["fastckpt"] == "fastckpt.cli:main"  # the command keeps its name

    from fastckpt.bench import report

    assert name in report.machine()["versions"]
