"""The benchmark harness: what ``fastckpt bench`` and the scripts in ``benchmarks/`` share.

One module per job, each light to import (torch is imported by the functions that need it):

- :mod:`~fastckpt.bench.units`: byte sizes, GB/s, medians;
- :mod:`~fastckpt.bench.filesystems`: the file system under a directory, free space, O_DIRECT;
- :mod:`~fastckpt.bench.caches`: cold and hot page caches, durability (fsync);
- :mod:`~fastckpt.bench.measure`: wall and CPU seconds, peak RSS, busy threads of a section;
- :mod:`~fastckpt.bench.checks`: every page touched, CRC-32s of loaded tensors and files;
- :mod:`~fastckpt.bench.ceilings`: the parallel ``preadv``/``pwrite`` ceilings of a file;
- :mod:`~fastckpt.bench.rawio`: timed raw reads and writes through an ``aio_handle``;
- :mod:`~fastckpt.bench.fio`: fio's figures for the device;
- :mod:`~fastckpt.bench.synthetic`: LLM-like state dicts of a requested size;
- :mod:`~fastckpt.bench.peers`: the savers and loaders compared (fastckpt and its peers);
- :mod:`~fastckpt.bench.timed_runs`: one timed save or load in a child process;
- :mod:`~fastckpt.bench.children`: running measurements in fresh child processes;
- :mod:`~fastckpt.bench.results`: every round kept, medians per method;
- :mod:`~fastckpt.bench.report`: Markdown tables, progress lines, the machine's versions.

The harness calls the layers below it (:mod:`fastckpt.checkpoint`, :mod:`fastckpt.io`,
:mod:`fastckpt.deepnvme`, :mod:`fastckpt.config`), never the command line above it.
"""
