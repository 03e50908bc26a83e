"""``fastckpt tune``: find the fastest I/O configuration for a file system, and remember it.

One module per job, each importing only those before it:

- :mod:`~fastckpt.cli.tune.sweep`: the values tried and the measuring of each configuration;
- :mod:`~fastckpt.cli.tune.tuned_file`: the winner saved where :mod:`fastckpt.config` reads it;
- :mod:`~fastckpt.cli.tune.sweep_log`: ``--log_dir``, one JSON line per measurement;
- :mod:`~fastckpt.cli.tune.plot`: ``--plot``, GB/s against each swept parameter;
- :mod:`~fastckpt.cli.tune.command`: the arguments, the run and what it prints.

Example:
    >>> from fastckpt.cli import tune
    >>> tune.add_parser.__module__
    'fastckpt.cli.tune.command'
"""

from fastckpt.cli.tune.command import add_parser, run

__all__ = ["add_parser", "run"]
