"""Runs Lightning's own tests with fastckpt's Lightning classes in place of Lightning's.

Lightning's test sources are not in its wheel; take them from the repository at the tag of
the installed version, then point this script at the directory that holds ``tests_pytorch``:

    git clone --depth 1 --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
    python benchmarks/lightning_suite.py --mode io --tests /tmp/pl/tests -- \
        tests_pytorch/checkpointing tests_pytorch/models/test_restore.py -q -p no:cacheprovider

Modes (one per run, since each changes process-wide defaults before the tests are imported):

- ``io``: a Trainer's default ``CheckpointIO`` is :class:`FastCkptIO` (where Lightning makes
  ``TorchCheckpointIO()`` for a strategy that got no plugin).
- ``async``: the same with :class:`AsyncFastCkptIO`.
- ``callback``: ``ModelCheckpoint``, as the tests import it from ``lightning.pytorch.callbacks``
  and as the Trainer adds it by default, is :class:`FastCkptCheckpoint`.
- ``none``: nothing swapped, the baseline (a test failing here fails for reasons of its own).

``--read-fastckpt`` makes ``torch.load`` of a fastckpt file by a test (one that opens a
checkpoint with ``torch.load`` or Lightning's ``cloud_io._load`` to check its content) read it
with fastckpt's loader; every other call (Lightning's own ``TorchCheckpointIO`` among them)
and every other file is unchanged. Without it those tests fail at ``torch.load`` (the file
is no pickle) before they check anything.

``--timeout`` (seconds, default 300) stops a test that hangs (``SIGALRM``) so that the run goes
on. Arguments after ``--`` go to pytest. The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pytest


def _swap_checkpoint_io(make: Any) -> None:
    """Makes ``make()`` the CheckpointIO a strategy creates when it was given none.

    ``Strategy.checkpoint_io`` calls the name ``TorchCheckpointIO`` of its own module; the
    tests' own references to ``TorchCheckpointIO`` (``isinstance`` checks, explicit plugins)
    keep Lightning's class.
    """
    import lightning.pytorch.strategies.strategy as strategy

    strategy.TorchCheckpointIO = make  # type: ignore[attr-defined]


def _swap_model_checkpoint() -> None:
    """Makes ``ModelCheckpoint`` resolve to :class:`FastCkptCheckpoint` for the tests.

    The module that defines ``ModelCheckpoint`` keeps it (its methods name their own class);
    the package names the tests import from, and the Trainer's default callback, change.
    """
    import lightning.pytorch as pl
    import lightning.pytorch.callbacks as callbacks
    import lightning.pytorch.trainer.connectors.callback_connector as connector

    from fastckpt.integrations.lightning import FastCkptCheckpoint

    callbacks.ModelCheckpoint = FastCkptCheckpoint  # type: ignore[misc]
    connector.ModelCheckpoint = FastCkptCheckpoint  # type: ignore[misc]
    if hasattr(pl, "ModelCheckpoint"):
        pl.ModelCheckpoint = FastCkptCheckpoint  # type: ignore[attr-defined]


def swap(mode: str) -> None:
    """Installs fastckpt's classes for ``mode`` (``io``, ``async``, ``callback`` or ``none``).

    Example:
        >>> swap("io")  # doctest: +SKIP
    """
    from fastckpt.integrations.lightning import AsyncFastCkptIO, FastCkptIO

    if mode == "io":
        _swap_checkpoint_io(FastCkptIO)
    elif mode == "async":
        _swap_checkpoint_io(AsyncFastCkptIO)
    elif mode == "callback":
        _swap_model_checkpoint()
    elif mode != "none":
        raise ValueError(f"mode must be io, async, callback or none, got {mode!r}")


def read_fastckpt_with_torch_load(tests: str) -> None:
    """Makes ``torch.load``, called by a test under ``tests`` (directly or through Lightning's
    ``cloud_io._load``), read fastckpt files with fastckpt's loader.

    Example:
        >>> read_fastckpt_with_torch_load("/tmp/pl/tests")  # doctest: +SKIP
    """
    tests = os.path.abspath(tests) + os.sep
    import torch

    from fastckpt.integrations.lightning_checkpoint_io import _is_torch_file, _load

    torch_load = torch.load

    def local_path(f: Any) -> str | None:
        # Lightning's cloud_io._load hands torch.load an open fsspec file of a local path.
        name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "path", None)
        name = name if name is not None else getattr(f, "name", None)
        if isinstance(name, (str, os.PathLike)) and os.path.isfile(name):
            return os.fspath(name)
        return None

    def called_from_a_test() -> bool:
        # The test itself, or Lightning's cloud_io._load called by the test; never Lightning's
        # own TorchCheckpointIO, which cannot read fastckpt files (a Trainer without them).
        frame = sys._getframe(2)
        for _ in range(2):
            if frame is None:
                return False
            if os.path.abspath(frame.f_code.co_filename).startswith(tests):
                return True
            if not frame.f_code.co_filename.endswith(os.path.join("utilities", "cloud_io.py")):
                return False
            frame = frame.f_back
        return False

    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        path = local_path(f)
        if path is not None and called_from_a_test() and not _is_torch_file(path):
            return _load(path, map_location, kwargs.get("weights_only"))
        return torch_load(f, map_location, *args, **kwargs)

    torch.load = load


class _Timeout:
    """Pytest plugin: a test running past ``seconds`` fails with ``TimeoutError``."""

    def __init__(self, seconds: int):
        self.seconds = seconds

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: Any) -> Iterator[None]:
        def expire(signum: int, frame: Any) -> None:
            raise TimeoutError(f"{item.nodeid} ran past {self.seconds} s")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.alarm(self.seconds)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("io", "async", "callback", "none"), required=True)
    parser.add_argument("--tests", required=True, help="directory holding tests_pytorch")
    parser.add_argument("--read-fastckpt", action="store_true")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)
    os.chdir(args.tests)
    sys.path.insert(0, args.tests)
    swap(args.mode)
    if args.read_fastckpt:
        read_fastckpt_with_torch_load(args.tests)
    return int(pytest.main(args.pytest_args, plugins=[_Timeout(args.timeout)]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
