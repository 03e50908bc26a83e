"""The guides read as a manual: measurements (dated runs) live in docs/benchmarks.md, and the
guides to a run's checkpoints and to asynchronous saves end with a plain list of the calls and
their defaults, kept in step with the code."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import fastckpt

DOCS = Path(__file__).resolve().parent.parent / "docs"
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b")


@pytest.mark.parametrize("page", ["series.md", "async.md"])
def test_guides_hold_no_dated_measurements(page):
    text = (DOCS / page).read_text(encoding="utf-8")
    assert DATED.findall(text) == [], f"{page}: dated runs belong in benchmarks.md"
    assert "benchmarks.md" in text  # and it says where they are


def _last_section(page: str) -> tuple[str, str]:
    text = (DOCS / page).read_text(encoding="utf-8")
    heading = text.rindex("\n## ")
    title, _, body = text[heading + 4 :].partition("\n")
    return title, body


def test_series_ends_with_the_managers_arguments_and_methods():
    title, body = _last_section("series.md")
    assert title == "Methods and defaults"
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", body, re.M)}
    parameters = inspect.signature(fastckpt.CheckpointManager.__init__).parameters
    for name, parameter in parameters.items():
        if name == "self":
            continue
        assert name in rows, f"series.md does not list {name}="
        if parameter.default is not inspect.Parameter.empty:
            assert rows[name].strip() == f"`{parameter.default!r}`", (name, rows[name])
    public = [n for n, _ in inspect.getmembers(fastckpt.CheckpointManager) if not n.startswith("_")]
    for name in public:
        assert f"`{name}" in body, f"series.md does not list {name}"


def test_async_ends_with_its_functions_and_defaults():
    title, body = _last_section("async.md")
    assert title == "Functions and defaults"
    for name in ("async_save", "async_load", "wait_all", "prepare_staging", "release_staging"):
        assert f"`fastckpt.{name}(" in body, name
    for method in ("result", "wait", "done", "fence"):
        assert f".{method}(" in body, method
    defaults = inspect.signature(fastckpt.async_save).parameters
    for name in ("snapshot", "lazy", "max_pending", "spare_file"):
        assert f"`{name}={defaults[name].default!r}`" in body, name
