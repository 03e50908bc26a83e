"""``fastckpt tune --log_dir``: one JSON line per measured configuration, written as it goes.

Example:
    >>> import json, tempfile
    >>> from fastckpt.cli.tune.sweep import Result
    >>> log = SweepLog.open(tempfile.mkdtemp(), dirs=["/nvme"], io_size=1 << 20)
    >>> log.write(Result({"queue_depth": 8}, read=[1.23456]), "sweep")
    >>> log.close()
    >>> with open(log.path) as f:
    ...     json.loads(f.read())["read_gbps"]
    [1.2346]
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import IO, Any

from fastckpt.cli._common import USAGE, CliError, make_directory
from fastckpt.cli.tune.sweep import Result

__all__ = ["SweepLog"]


class SweepLog:
    """A JSON-lines file of measurements, flushed after every line."""

    def __init__(self, file: IO[str], dirs: Sequence[str], io_size: int) -> None:
        self._file, self.dirs, self.io_size = file, list(dirs), io_size
        self.path = file.name

    @classmethod
    def open(cls, log_dir: str, *, dirs: Sequence[str], io_size: int) -> SweepLog:
        """A new file in ``log_dir`` (its last component created when missing), named by the
        time and process.

        Raises:
            CliError: (status 2) the directory or file cannot be created.
        """
        make_directory("--log_dir", log_dir)
        try:
            name = time.strftime("tune-%Y%m%d-%H%M%S") + f"-{os.getpid()}.jsonl"
            return cls(open(os.path.join(log_dir, name), "w", encoding="utf-8"), dirs, io_size)
        except OSError as exc:
            raise CliError(f"--log_dir {log_dir}: {exc}", USAGE) from None

    def write(self, result: Result, phase: str) -> None:
        """One line: the phase, the configuration, GB/s per run, the error if any."""
        record: dict[str, Any] = {
            "phase": phase,
            **result.config,
            "io_size": self.io_size,
            "dirs": self.dirs,
            "read_gbps": [round(x, 4) for x in result.read],
            "write_gbps": [round(x, 4) for x in result.write],
        }
        if result.error:
            record["error"] = result.error
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
