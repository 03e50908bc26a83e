"""Shared fixtures: the engines available here, the directories to test on, CUDA skips."""

from __future__ import annotations

import os
import tempfile

import pytest

import fastckpt
from fastckpt.io.engines import ENGINE_NAMES


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The default run's longest tests, started first so that no worker is left running one of
# them alone at the end of the run (with ``--dist worksteal``, in pyproject.toml's addopts,
# the other worker takes over the short tests queued behind them).
LONGEST_FIRST = (
    "tests/test_install.py",
    "tests/test_torture_smoke.py",
    "tests/test_examples.py",
    "tests/distributed/",
    "tests/integrations/test_lightning",
    "tests/checkpoint/test_tree.py::test_a_set_is_written_alike_whatever_the_hash_seed",
)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(LONGEST_FIRST))  # stable
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


AVAILABLE_ENGINES = [name for name in ENGINE_NAMES if fastckpt.engines()[name].available]


@pytest.fixture(params=AVAILABLE_ENGINES)
def engine(request) -> str:
    """Each native engine this machine can run: the conformance suite runs once per engine."""
    return request.param


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.fixture(params=["disk", "tmpfs"])
def io_dir(request, tmp_path):
    """A directory on the disk (tmp_path) and one on tmpfs, where O_DIRECT may be refused."""
    if request.param == "disk":
        yield tmp_path
        return
    shm = _shm_dir()
    if shm is None:
        pytest.skip("no writable /dev/shm")
    with tempfile.TemporaryDirectory(dir=shm, prefix="fastckpt-test-") as d:
        yield d


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path_factory, monkeypatch):
    """Never read or write the user's tuned configuration from tests."""
    monkeypatch.setenv("FASTCKPT_CONFIG", str(tmp_path_factory.mktemp("cfg") / "tuned.json"))
    for key in list(os.environ):
        if key.startswith("FASTCKPT_") and key not in ("FASTCKPT_CONFIG",):
            monkeypatch.delenv(key)
