"""The ``fastckpt`` command line: ``tune``, ``bench``, ``inspect``, ``convert``, ``verify``, and
for the checkpoint series of :class:`~fastckpt.series.manager.CheckpointManager`: ``ls``,
``clean``, ``prune``.

Run as the ``fastckpt`` console script or ``python -m fastckpt``; ``--help`` on any command
lists its options. Exit statuses: 0 success, 1 failure (damage found, a file refused or
unreadable), 2 usage and input errors (a missing path, an existing output without
``--force``, a file of the wrong kind such as a torch.save file given to ``verify``, and what
this machine cannot do, such as ``--gpu`` without CUDA). Progress bars go to stderr, only on
a terminal and only without ``FASTCKPT_NO_PROGRESS``. Options with two words are spelled
with ``-`` or ``_`` alike (``--allow-pickle`` or ``--allow_pickle``).

Example:
    >>> from fastckpt.cli import main
    >>> main(["--version"])  # doctest: +ELLIPSIS
    fastckpt ...
    0
    >>> main(["inspect"])  # a usage error: the file is missing
    2
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fastckpt.cli._common import FAILURE, USAGE, CliError

__all__ = ["build_parser", "main"]

_COMMANDS = ("tune", "bench", "inspect", "convert", "verify", "ls", "clean", "prune")


def build_parser() -> argparse.ArgumentParser:
    """The ``fastckpt`` argument parser with every command registered.

    Example:
        >>> args = build_parser().parse_args(["verify", "model.safetensors"])
        >>> args.command, args.paths
        ('verify', ['model.safetensors'])
    """
    from fastckpt import __version__
    from fastckpt.cli import bench, clean, convert, inspect, ls, prune, tune, verify

    parser = argparse.ArgumentParser(
        prog="fastckpt",
        description="PyTorch checkpoints at the speed of the storage device: tune and measure "
        "the I/O engine, inspect, convert and verify checkpoint files, list and tidy the "
        "steps of a checkpoint series.",
    )
    parser.add_argument("--version", action="version", version=f"fastckpt {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Kept so that a misspelled option is reported with its command's usage, not fastckpt's.
    parser.commands = {  # type: ignore[attr-defined]
        name: module.add_parser(subparsers)
        for name, module in zip(
            _COMMANDS, (tune, bench, inspect, convert, verify, ls, clean, prune)
        )
    }
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns its exit status (the console script exits with it).

    Example:
        >>> main(["verify", "/no/such/file.safetensors"])
        2
    """
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:
            owner = getattr(parser, "commands", {}).get(args.command, parser)
            owner.error(f"unrecognized arguments: {' '.join(extras)}")
    except SystemExit as exc:  # --help, --version, or a usage error (argparse exits 2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else USAGE)
    if args.command is None:
        parser.print_usage(sys.stderr)
        print(f"fastckpt: error: a command is required: {', '.join(_COMMANDS)}", file=sys.stderr)
        return USAGE
    from fastckpt.errors import FastCkptError

    try:
        return args.run(args)
    except CliError as exc:
        _error(args.command, str(exc))
        return exc.status
    except KeyboardInterrupt:
        _error(args.command, "interrupted")
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        return FAILURE
    except (OSError, FastCkptError) as exc:
        # Conditions of the files and the machine, not bugs: one line, no traceback.
        _error(args.command, str(exc))
        return FAILURE


def _error(command: str, message: str) -> None:
    sys.stdout.flush()
    print(f"fastckpt {command}: error: {message}", file=sys.stderr, flush=True)
